"""All-reduce benchmark: time, algbw and busbw per size and world size (nccl-tests definitions).

Method (per size): warm-up calls (not timed), then `iters` timed calls, each between a barrier and a
device synchronize; the per-call times are maxed over ranks (the slowest rank decides) and the median
over calls is reported (`time_us`; `min_time_us` is the fastest call).

    algbw = size_bytes / time            (what the caller sees)
    busbw = algbw · 2(n-1)/n              (n ranks; a ring all-reduce moves 2(n-1)/n of the buffer per rank,
                                           so busbw is comparable across world sizes and with the link speed)
GB/s means 1e9 bytes per second. The tensor is float32 unless told otherwise.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ddp_lib.bench.timing import comm_device, median, progress, slowest_rank, start_clock, stop_clock
from ddp_lib.launch import run_on_ranks

MB = 2**20
DEFAULT_SIZES = [MB * 2**i for i in range(11)]  # 1 MiB .. 1 GiB


def bus_factor(world_size: int) -> float:
    """busbw / algbw for all-reduce: 2(n-1)/n."""
    return 2 * (world_size - 1) / world_size


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
    bar = progress(len(sizes), f"all-reduce {backend} x{ws}")
    for size in sizes:
        x = torch.full((max(1, size // elem),), 1.0 / ws, dtype=dtype, device=device)  # the sum stays ~1
        t0 = start_clock(device)
        for _ in range(max(1, warmup)):
            dist.all_reduce(x)
        per_call = slowest_rank([stop_clock(device, t0) / max(1, warmup)], device)[0]
        n_iters = max(3, min(iters, int(budget_s / max(per_call, 1e-9))))
        times = []
        for _ in range(n_iters):
            t0 = start_clock(device)
            dist.all_reduce(x)
            times.append(stop_clock(device, t0))
        worst = slowest_rank(times, device)
        t = median(worst)
        nbytes = x.numel() * elem
        algbw = nbytes / t / 1e9
        rows.append(dict(backend=backend, world_size=ws, size_bytes=nbytes, dtype=str(dtype).removeprefix("torch."),
                         iters=n_iters, time_us=t * 1e6, min_time_us=min(worst) * 1e6,
                         algbw_GBps=algbw, busbw_GBps=algbw * bus_factor(ws)))
        del x
        bar.update()
    bar.close()
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
    """A fixed-width table of allreduce rows."""
    head = f"{'backend':>7} {'ranks':>5} {'size':>10} {'time_us':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['backend']:>7} {r['world_size']:>5} {human_bytes(r['size_bytes']):>10} "
                     f"{r['time_us']:>11.1f} {r['algbw_GBps']:>11.3f} {r['busbw_GBps']:>11.3f}")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    """1048576 -> '1 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} GiB"
