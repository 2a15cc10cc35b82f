"""All-reduce benchmark: time, algbw and busbw per size and world size (nccl-tests definitions).

Method: untimed one-element calls for 0.2 s first (connections, buffers, idle ranks); then per size its own
warm-up calls (not timed), then `iters` timed calls, each between a barrier and a device synchronize. The per-call times
are maxed over ranks (the slowest rank decides); over calls each row reports the median (`time_us`),
the quartiles (`p25_time_us`, `p75_time_us`), the extremes (`min_time_us`, `max_time_us`) and the mean
(`mean_time_us`: what a stream of such calls costs per call, slow ones included).

    algbw = size_bytes / time            (what the caller sees)
    busbw = algbw · 2(n-1)/n              (n ranks; a ring all-reduce moves 2(n-1)/n of the buffer per rank,
                                           so busbw is comparable across world sizes and with the link speed)
GB/s means 1e9 bytes per second. The tensor is float32 unless told otherwise.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ddp_lib import comm
from ddp_lib.devices import comm_device
from ddp_lib.bench.timing import progress, slowest_rank, start_clock, stop_clock
from ddp_lib.launch import run_on_ranks

MB = 2**20
DEFAULT_SIZES = [MB * 2**i for i in range(11)]  # 1 MiB .. 1 GiB


def bus_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: 2(n-1)/n."""
    return 2 * (world_size - 1) / world_size


def bandwidths(size_bytes: float, time_s: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes/s) of an all-reduce of `size_bytes` taking `time_s` on `world_size` ranks."""
    algbw = size_bytes / time_s / 1e9
    return algbw, algbw * bus_factor(world_size)


def spread(times_s: list[float]) -> dict[str, float]:
    """Median, quartiles (inclusive method), extremes and mean of a list of seconds, as microsecond columns."""
    q1, med, q3 = statistics.quantiles(times_s, n=4, method="inclusive") if len(times_s) > 1 else [times_s[0]] * 3
    return dict(time_us=med * 1e6, p25_time_us=q1 * 1e6, p75_time_us=q3 * 1e6, min_time_us=min(times_s) * 1e6,
                max_time_us=max(times_s) * 1e6, mean_time_us=statistics.fmean(times_s) * 1e6)


def machine_label(device: torch.device | None = None) -> str:
    """'1x NVIDIA H100 80GB HBM3' or '2-core CPU (x86_64)': what a figure or a saved fit says it ran on.

    `device`: where the ranks communicated; default: the group's communication device (outside the ranks: what
    ranks started with no backend pick), so GPUs that gloo ranks never used are not named."""
    from ddp_lib.devices import ranks_use_cuda

    if (device.type == "cuda") if device is not None else ranks_use_cuda():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"{os.cpu_count()}-core CPU ({platform.machine()})"


def link_label(device: torch.device, backend: str) -> str:
    """What a race ran over, named truly: 'loopback (gloo)' for CPU ranks (the local network stack), else the
    backend between this box's GPUs, e.g. 'nccl, GPU to GPU (Tesla T4)' (NVLink, PCIe or host memory: which one NCCL
    chose is in its NCCL_DEBUG=INFO log, `make gpu-check` reads it)."""
    if device.type != "cuda":
        return f"loopback ({backend})"
    return f"{backend}, GPU to GPU ({torch.cuda.get_device_name(device)})"


def warm_up_group(device: torch.device, seconds: float = 0.2) -> int:
    """Tiny all-reduces for about `seconds` (ranks agree when to stop), so no size pays for the group's start.

    The first calls of a process group pay for connections and buffers, and ranks that were idle take a while to
    run at speed; a fixed handful of calls was not enough on a shared CPU. Returns the number of calls made.
    """
    deadline, calls = time.perf_counter() + seconds, 0
    go = torch.ones(1, device=device)
    while go.item() > 0:  # a host sync per call: fine here, nothing is timed yet
        go.fill_(1.0 if time.perf_counter() < deadline else 0.0)
        comm.all_reduce(go, op=dist.ReduceOp.MIN)  # stop together, when any rank's deadline has passed
        calls += 1
    return calls


def check_sum(x: torch.Tensor, dtype: torch.dtype) -> None:
    """Raise if an all-reduced buffer of 1/ws per rank does not hold ~1 everywhere (a broken backend or buffer)."""
    from ddp_lib import gpusim

    if not dtype.is_floating_point or gpusim.dry():  # a dry run's collectives move nothing: no values to check
        return
    tol = 1e-2 if dtype.itemsize < 4 else 1e-5  # 1/3 is inexact; bf16/fp16 keep 8-11 bits of mantissa
    lo, hi = x.aminmax()
    if abs(lo.item() - 1.0) > tol or abs(hi.item() - 1.0) > tol:
        raise RuntimeError(f"all-reduce of 1/world_size per rank gave values in [{lo.item()}, {hi.item()}], "
                           "expected 1 everywhere")


def memory_cap_bytes(world_size: int, device: torch.device | None = None) -> int:
    """The largest buffer worth trying: a third of free GPU memory, or of free RAM shared by the local ranks."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 3
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        free = 8 * 2**30
    return free // (3 * world_size)


def allreduce_rank_bench(sizes: list[int] | None = None, iters: int = 10, warmup: int = 3,
                         dtype: torch.dtype = torch.float32, budget_s: float = 5.0) -> list[dict]:
    """On the current process group: one row per size (bytes). Call it on every rank; all get the rows.

    Sizes above the memory cap are skipped; a size whose warm-up says `iters` calls would exceed
    `budget_s` gets fewer timed calls (at least 3), agreed across ranks.
    """
    device, ws, backend = comm_device(), dist.get_world_size(), dist.get_backend()
    cap = min(slowest_rank([-memory_cap_bytes(ws, device)], device))  # the smallest cap of any rank
    elem = dtype.itemsize
    sizes = [s for s in (sizes or DEFAULT_SIZES) if s <= -cap]
    rows = []
    warm_up_group(device)
    # a bar only on a terminal: in a notebook or a log it leaves a line of blanks behind
    bar = progress(len(sizes), f"all-reduce {backend} x{ws}") if sys.stderr.isatty() else None
    for size in sizes:
        x = torch.empty((max(1, size // elem),), dtype=dtype, device=device)
        t0 = start_clock(device)
        for _ in range(max(1, warmup)):
            x.fill_(1.0 / ws)  # every call sums 1/ws over ws ranks: the values stay 1, never ws**calls
            comm.all_reduce(x)
        per_call = slowest_rank([stop_clock(device, t0) / max(1, warmup)], device)[0]
        n_iters = max(3, min(iters, int(budget_s / max(per_call, 1e-9))))
        times = []
        for _ in range(n_iters):
            x.fill_(1.0 / ws)  # refilled outside the timed region (start_clock drains the device first)
            t0 = start_clock(device)
            comm.all_reduce(x)
            times.append(stop_clock(device, t0))
        check_sum(x, dtype)
        worst = slowest_rank(times, device)
        stats = spread(worst)
        nbytes = x.numel() * elem
        algbw, busbw = bandwidths(nbytes, stats["time_us"] * 1e-6, ws)
        rows.append(dict(backend=backend, world_size=ws, size_bytes=nbytes, dtype=str(dtype).removeprefix("torch."),
                         iters=n_iters, **stats, algbw_GBps=algbw, busbw_GBps=busbw))
        del x
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return rows


def allreduce_pipelined_rank_bench(sizes: list[int] | None = None, iters: int = 20, warmup: int = 3, repeats: int = 3,
                                   dtype: torch.dtype = torch.float32, budget_s: float = 5.0,
                                   clock=None) -> list[dict]:
    """nccl-tests' way: per size, `iters` all-reduces launched back to back with one device synchronize at the end,
    time / iters per call; `repeats` such runs (the median is `time_us`). Call it on every rank; all get the rows.

    `allreduce_rank_bench` puts a barrier and a synchronize around every call, so its α holds each call's launch,
    host overhead and the ranks lining up: the cost of a call on its own (lesson 01's fit). Here the host queues the
    next call while the device still runs the last one, so what one call costs in a stream of calls (the naive
    engine's per-parameter calls, DDP's buckets: lessons 04 and 05) is measured; on a GPU it is the smaller α.
    The buffer holds zeros (sums of zeros stay zero, so no refill between calls). Rows carry `method="pipelined"`.
    `clock`: (start, stop) functions in place of `start_clock` / `stop_clock` (tests)."""
    start, stop = clock or (start_clock, stop_clock)
    device, ws, backend = comm_device(), dist.get_world_size(), dist.get_backend()
    cap = min(slowest_rank([-memory_cap_bytes(ws, device)], device))
    elem = dtype.itemsize
    sizes = [s for s in (sizes or DEFAULT_SIZES) if s <= -cap]
    rows = []
    warm_up_group(device)
    for size in sizes:
        x = torch.zeros((max(1, size // elem),), dtype=dtype, device=device)
        t0 = start(device)
        for _ in range(max(1, warmup)):
            comm.all_reduce(x)
        per_call = slowest_rank([stop(device, t0) / max(1, warmup)], device)[0]
        n_iters = max(2, min(iters, int(budget_s / max(1, repeats) / max(per_call, 1e-9))))  # agreed: the max
        runs = []
        for _ in range(max(1, repeats)):
            t0 = start(device)
            for _ in range(n_iters):
                comm.all_reduce(x)  # no barrier, no synchronize: the next call is queued behind this one
            runs.append(stop(device, t0) / n_iters)
        stats = spread(slowest_rank(runs, device))
        nbytes = x.numel() * elem
        algbw, busbw = bandwidths(nbytes, stats["time_us"] * 1e-6, ws)
        rows.append(dict(backend=backend, world_size=ws, size_bytes=nbytes, dtype=str(dtype).removeprefix("torch."),
                         iters=n_iters, repeats=max(1, repeats), method="pipelined", **stats, algbw_GBps=algbw,
                         busbw_GBps=busbw))
        del x
    return rows


def run_allreduce_bench(sizes: list[int] | None = None, world_sizes: list[int] | tuple[int, ...] = (2,),
                        backend: str | None = None, max_size: int | None = None, iters: int = 10,
                        warmup: int = 3, dtype: torch.dtype = torch.float32, budget_s: float = 5.0,
                        timeout_s: float = 900.0) -> list[dict]:
    """Rows for every world size: spawned local ranks, or the current process group (torchrun/notebook) only."""
    sizes = [s for s in (sizes or DEFAULT_SIZES) if max_size is None or s <= max_size]
    kwargs = dict(sizes=sizes, iters=iters, warmup=warmup, dtype=dtype, budget_s=budget_s)
    if dist.is_initialized() or "RANK" in os.environ:  # one world: the one we are in
        return run_on_ranks(allreduce_rank_bench, 0, kwargs=kwargs, backend=backend, timeout_s=timeout_s)
    rows: list[dict] = []
    for ws in world_sizes:
        rows += run_on_ranks(allreduce_rank_bench, ws, kwargs=kwargs, backend=backend, timeout_s=timeout_s, threads=1)
    return rows


def format_allreduce(rows: list[dict]) -> str:
    """A fixed-width table of allreduce rows: median time, its quartiles and extremes, algbw and busbw of the median."""
    head = (f"{'backend':>7} {'ranks':>5} {'size':>9} {'calls':>5} {'median us':>10} {'IQR us':>17} "
            f"{'min-max us':>17} {'algbw GB/s':>10} {'busbw GB/s':>10}")
    lines = [head]
    for r in rows:
        iqr = f"{r['p25_time_us']:.0f}-{r['p75_time_us']:.0f}"
        rng = f"{r['min_time_us']:.0f}-{r['max_time_us']:.0f}"
        lines.append(f"{r['backend']:>7} {r['world_size']:>5} {human_bytes(r['size_bytes']):>9} {r['iters']:>5} "
                     f"{r['time_us']:>10.0f} {iqr:>17} {rng:>17} {r['algbw_GBps']:>10.3f} "
                     + (f"{r['busbw_GBps']:>10.3f}" if r["world_size"] > 1 else f"{'n/a, 1 rank':>10}"))
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    """1048576 -> '1 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} GiB"
