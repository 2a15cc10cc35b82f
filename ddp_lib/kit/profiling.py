"""Lesson 06: profile training steps with torch.profiler: operator/kernel tables, a trace, comm vs compute.

Works under gloo on CPU (comm = the `gloo:all_reduce` spans, which run on gloo's own thread) and NCCL
on CUDA (comm = the `nccl*` kernels on the GPU, compute = every other kernel). With several ranks, the time
inside collectives is split into waiting for the slowest rank to arrive and moving the data. The arithmetic on
the profiler's spans (which are communication, the comm/compute split) lives in `ddp_lib.kit.spans`.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import textwrap
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

from ddp_lib import comm, comm_records
from ddp_lib.devices import ranks_use_cuda, release_host_heap
# the span arithmetic lives in ddp_lib.kit.spans; is_comm and comm_compute_split stay importable from here
from ddp_lib.kit.spans import (comm_compute_split, comm_compute_split_and_per_window, exposed_breakdown,  # noqa: F401
                               idle_share, intersection, is_comm, is_label, length, union)
from ddp_lib.comm_records import phase, profiler_on, traced  # noqa: F401  (the labels live below the collectives layer)

# Kineto prints these two lines on every profiler start/stop at its highest log level (KINETO_LOG_LEVEL
# cannot hide them without hiding its errors too), so exactly these are dropped from stderr. On torch's CUDA
# build without a usable GPU, its device probe also logs "ERROR:... gpuGetDeviceCount failed with code N" when
# the profiler starts: harmless there (the ranks do not use a GPU), so that exact line is dropped too.
_KINETO_NOISE = re.compile(rb"^(USDT:.*\] profiler_(start|stop)"
                           rb"|ERROR:.*\] gpuGetDeviceCount failed with code \d+)\s*$")


@contextlib.contextmanager
def without_kineto_noise() -> Iterator[None]:
    """Forward this process's stderr (file descriptor 2, where C++ writes) minus Kineto's start/stop lines
    and its device probe's failure line on a machine without a usable GPU."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr: nothing to filter
        yield
        return
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)

    def forward() -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            for line in pipe:
                if not _KINETO_NOISE.match(line):
                    os.write(saved, line)

    thread = threading.Thread(target=forward, name="stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the thread sees EOF and ends
        thread.join(timeout=5)
        os.close(saved)


@dataclass
class ProfileResult:
    """What `profile_steps` measured; times are milliseconds per step, averaged over the active steps."""

    steps: int
    step_ms: float
    comm_ms: float  # wall time with a collective in flight
    compute_ms: float  # wall time with a compute op (CPU) or compute kernel (CUDA) running
    overlap_ms: float  # both at once: communication hidden behind compute
    phases_ms: dict[str, float]  # our labels ("train.*", the engines' "ddp.*"): CUDA events on GPUs, else host
    operators: list[dict[str, Any]]  # top-k operators by self CPU time
    kernels: list[dict[str, Any]]  # top-k CUDA kernels by self device time (empty on CPU)
    comm_ops: list[dict[str, Any]]  # every collective op or kernel seen
    operator_table: str
    kernel_table: str
    trace_path: str | None
    device: str = "cpu"
    # the time inside the backend's collectives, split: waiting for the last rank to arrive at each collective,
    # and the rest, moving and reducing the data (NaN with one process, or if ranks saw different collectives)
    wait_ms: float = float("nan")
    transfer_ms: float = float("nan")
    phase_clock: str = "host"  # what timed phases_ms: "host" (CPU ranks) or "cuda events"
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # the events the split was computed from
    windows: list[tuple[float, float]] = field(default_factory=list)  # the profiled steps' (start_us, end_us)
    # each profiled step on its own: step_ms and comm_compute_split's comm/compute/hidden/exposed ms (for spreads)
    per_step: list[dict[str, float]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    gpu_idle_share: float = float("nan")  # share of the steps with no kernel running: host-bound time (NaN on CPU)

    @property
    def exposed_ms(self) -> float:
        """Communication the step waited for: time with a collective in flight and no compute (comm - overlap)."""
        return self.comm_ms - self.overlap_ms

    @property
    def comm_share(self) -> float:
        """Fraction of a step's wall time during which an all-reduce (or other collective) was in flight."""
        return self.comm_ms / self.step_ms if self.step_ms else 0.0

    def summary(self) -> str:
        """One line: step time, comm share (waiting vs moving data), how much of it overlapped compute."""
        split = "" if self.wait_ms != self.wait_ms else (  # NaN: no split measured
            f", of which {self.wait_ms:.1f} ms waiting for the slowest rank + {self.transfer_ms:.1f} ms moving data"
            f" (inside the collectives)")
        return (f"{self.steps} steps on {self.device}: {self.step_ms:.1f} ms/step, comm {self.comm_ms:.1f} ms "
                f"({100 * self.comm_share:.0f} % of the step){split}, compute {self.compute_ms:.1f} ms, "
                f"overlap {self.overlap_ms:.1f} ms")

    def figure(self, title: str | None = None):
        """Where a step's time goes: the labelled phases, comm vs compute, and the top operators."""
        import matplotlib.pyplot as plt

        fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [1, 1.1]})
        parts = {k.removeprefix("train."): v for k, v in self.phases_ms.items() if k.startswith("train.")}
        parts["other"] = max(0.0, self.step_ms - sum(parts.values()))
        left = 0.0
        colors = ["C0", "C1", "C2", "C4", "C5", "C6", "C7", "C8"]  # C3, red, is kept for communication
        for color, (name, ms) in zip(colors, parts.items()):
            ax0.barh(["phases"], [ms], left=left, color=color, label=f"{name} {ms:.1f}")
            left += ms
        ax0.barh(["compute"], [self.compute_ms], color="0.6", label=f"compute {self.compute_ms:.1f}")
        if self.wait_ms == self.wait_ms:  # measured: the collectives' time as waiting + moving data
            ax0.barh(["communication"], [self.transfer_ms], color="C3", label=f"moving data {self.transfer_ms:.1f}")
            ax0.barh(["communication"], [self.wait_ms], left=self.transfer_ms, color="C3", alpha=0.35, hatch="//",
                     label=f"waiting for the slowest rank {self.wait_ms:.1f}")
        else:
            ax0.barh(["communication"], [self.comm_ms], color="C3", label=f"all-reduce in flight {self.comm_ms:.1f}")
        ax0.invert_yaxis()  # phases on top, as in the legend
        ax0.set_xlabel("ms per step")
        ax0.set_title(f"one step: {self.step_ms:.1f} ms, comm {100 * self.comm_share:.0f} % "
                      f"(overlap with compute {self.overlap_ms:.1f} ms)")
        ax0.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
        ops = self.kernels or self.operators
        key = "self_device_ms" if self.kernels else "self_cpu_ms"
        names = [textwrap.fill(o["name"], 60, break_long_words=False) for o in ops][::-1]  # never cut
        ax1.barh(names, [o[key] / self.steps for o in ops][::-1],
                 color=["C3" if is_comm(o["name"]) else "C0" for o in ops][::-1])
        ax1.set_xlabel(f"self {'GPU' if self.kernels else 'CPU'} ms per step")
        ax1.set_title("top kernels" if self.kernels else "top operators (red: communication)")
        ax1.tick_params(axis="y", labelsize=7)
        fig.suptitle(title or "where a training step's time goes")
        fig.tight_layout()
        return fig


def format_kernels(kernels: list[dict[str, Any]], steps: int, step_ms: float, idle: float) -> str:
    """The kernel table: kernels only (no step ranges or annotations), self GPU ms per step and share of the step,
    then the share of the step the GPU sat idle (host-bound time)."""
    lines = [f"{'kernel':<70} {'calls':>6} {'GPU ms/step':>11} {'of step':>7}"]
    for k in kernels:
        per_step = k["self_device_ms"] / max(1, steps)
        share = f"{per_step / step_ms:.0%}" if step_ms else "-"
        lines.append(f"{textwrap.shorten(k['name'], 70, placeholder='...'):<70} {k['calls']:>6} {per_step:>11.3f} "
                     f"{share:>7}")
    lines.append(f"GPU idle (no kernel running, host-bound): {idle:.0%} of the step" if idle == idle else "")
    return "\n".join(lines).rstrip()


def _row(e, steps: int) -> dict[str, Any]:
    return {"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "cpu_total_ms": e.cpu_time_total / 1e3, "self_device_ms": getattr(e, "self_device_time_total", 0) / 1e3,
            "device_total_ms": getattr(e, "device_time_total", 0) / 1e3,
            "cpu_mem_mb": getattr(e, "self_cpu_memory_usage", 0) / 2**20,
            "device_mem_mb": getattr(e, "self_device_memory_usage", 0) / 2**20}


def profile_steps(step_fn: Callable[[], Any], steps: int = 5, warmup: int = 1, top_k: int = 15,
                  trace_path: str | os.PathLike | None = "runs/profile/trace_rank{rank}.json",
                  record_shapes: bool = True, profile_memory: bool = True, with_stack: bool = False) -> ProfileResult:
    """Run `warmup` + `steps` calls of `step_fn` (one training step each) under torch.profiler.

    CPU activity always, CUDA when the ranks compute on GPUs (with torch.cuda.synchronize after each step, so a step's
    kernels land in its window, and the labelled phases timed by CUDA events, not the host clock). Writes a
    Chrome/Perfetto trace to `trace_path` ("{rank}" is filled in; None writes none) and returns tables, the
    comm/compute split and a figure maker. `warmup=0` makes torch warn that its results can be skewed.
    """
    cuda = ranks_use_cuda()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    clock = comm_records.clock = comm_records.DeviceClock() if cuda else None  # `phase` times itself on it
    try:
        with without_kineto_noise(), profile(activities=activities, record_shapes=record_shapes,
                                              schedule=schedule(wait=0, warmup=warmup, active=steps, repeat=1),
                                              profile_memory=profile_memory, with_stack=with_stack) as prof:
            for i in range(warmup + steps):
                step_fn()
                if clock is not None:
                    torch.cuda.synchronize()
                    clock.settle(keep=i >= warmup)
                prof.step()
    finally:
        comm_records.clock = None
    path = None
    if trace_path is not None:
        path = str(trace_path).format(rank=rank)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(path)

    events = prof.events()
    windows = step_windows(events)
    step_us = length(windows) / max(1, len(windows))
    # on CUDA the work is the kernels; on CPU the operators
    # on CUDA the GPU's timeline without kineto's copies of the host's labels (gpu_user_annotation): not kernels
    spans = [(e.name, e.time_range.start, e.time_range.end) for e in events
             if not cuda or e.device_type != torch.autograd.DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    idle = idle_share(spans, windows) if cuda else float("nan")  # the GPU waiting for the host
    split, per_window = comm_compute_split_and_per_window(spans, windows)  # one sort and merge of the spans for both
    n = max(1, len(windows))
    wait_us, transfer_us = _wait_and_transfer(prof, events, windows, cuda)

    avg = prof.key_averages(group_by_input_shape=False)
    real = [e for e in avg if not is_label(e.key)]
    gpu = [e for e in real if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA  # the kernels
           and not getattr(e, "is_user_annotation", False)]
    ops = sorted((e for e in real if e not in gpu), key=lambda e: e.self_cpu_time_total, reverse=True)[:top_k]
    kernels = sorted(gpu, key=lambda e: e.self_device_time_total, reverse=True)[:top_k]
    phases = ({k: v / n for k, v in clock.total_ms.items()} if clock is not None else
              {e.key: e.cpu_time_total / 1e3 / n for e in avg if e.key.startswith(("train.", "ddp."))})
    result = ProfileResult(
        steps=n, step_ms=step_us / 1e3, comm_ms=split["comm_ms"], compute_ms=split["compute_ms"],
        overlap_ms=split["hidden_ms"], phases_ms=phases,
        operators=[_row(e, n) for e in ops], kernels=[_row(e, n) for e in kernels],
        comm_ops=[_row(e, n) for e in avg if is_comm(e.key)],
        operator_table=avg.table(sort_by="self_cpu_time_total", row_limit=top_k),
        kernel_table=format_kernels([_row(e, n) for e in kernels], n, step_us / 1e3, idle) if cuda else "",
        trace_path=path, device="cuda" if cuda else "cpu", wait_ms=wait_us / 1e3 / n, transfer_ms=transfer_us / 1e3 / n,
        phase_clock="cuda events" if cuda else "host", spans=spans, windows=windows, gpu_idle_share=idle,
        per_step=[{"step_ms": (t - s) / 1e3, **one} for (s, t), one in zip(windows, per_window)])
    del prof, events, avg, real, gpu, ops, kernels  # the profiler's record: GiB for a few steps of an LLM
    release_host_heap()  # which glibc would keep resident after its free, for the rest of the lesson
    return result


def step_windows(events) -> list[tuple[float, float]]:
    """The profiled steps' (start, end), µs: the host's `ProfilerStep#N` ranges. With CUDA activity kineto also
    gives each step a device-side copy of the range (a GPU user annotation over its kernels, device type CUDA), which
    counted as a second step: on one H200 a single timed step read "2 steps" and every per-step figure was halved."""
    return sorted((e.time_range.start, e.time_range.end) for e in events
                  if e.name.startswith("ProfilerStep") and e.device_type == torch.autograd.DeviceType.CPU)


def _wait_and_transfer(prof, events, windows: list[tuple[float, float]], cuda: bool) -> tuple[float, float]:
    """(waiting, moving) in µs of wall time over the active steps: data moves once a collective's last rank is in.

    The backend's own spans (gloo's worker threads; NCCL kernels on CUDA) are matched across ranks by order.
    Each splits at the latest start on any rank: before it this rank waits for a slower one, after it the data
    moves. Collectives can run concurrently (gloo has two threads), so both are wall time: "moving" while any
    collective moves data, "waiting" while some wait and none moves. Timestamps are the host's clock: exact on
    one machine, across machines only as good as their clock sync. Every rank must call this (one all_gather).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return float("nan"), float("nan")
    base = prof.profiler.kineto_results.trace_start_ns() / 1e3  # event times are µs after this (unix epoch)
    spans = sorted((base + e.time_range.start, base + e.time_range.end) for e in events
                   if (e.name.startswith("gloo:") or (cuda and e.name.lower().startswith("nccl")))
                   and is_comm(e.name) and any(s <= e.time_range.start < t for s, t in windows))
    everyone: list[Any] = [None] * dist.get_world_size()
    comm.all_gather_object(everyone, spans)
    if len({len(x) for x in everyone}) != 1:
        return float("nan"), float("nan")
    last = [min(max(r[i][0] for r in everyone), b) for i, (_, b) in enumerate(spans)]  # when the data can move
    waiting = union([(a, t) for (a, _), t in zip(spans, last) if t > a])
    moving = union([(t, b) for (_, b), t in zip(spans, last) if b > t])
    return length(waiting) - intersection(waiting, moving), length(moving)
