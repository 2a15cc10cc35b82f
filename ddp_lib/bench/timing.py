"""Timing done right for distributed code: barrier, device sync, slowest rank, median; peak memory; rank-0 bars.

CPU memory is read where the platform offers it: /proc on Linux (a resettable peak), `resource` on macOS (peak
since the process started, in bytes there), psutil where it is installed (Windows). Where none is available the
memory functions return NaN and warn once: the timings never depend on them.
"""

from __future__ import annotations

import functools
import gc
import math
import statistics
import sys
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

try:
    import resource  # POSIX only: there is no such module on Windows
except ImportError:
    resource = None

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ddp_lib import comm
from ddp_lib.devices import comm_device

F = TypeVar("F", bound=Callable)


@contextmanager
def tf32_matmuls(device: torch.device) -> Iterator[bool]:
    """fp32 matmuls on TF32 tensor cores while a timing runs on a CUDA device (cuBLAS's flag, which torch ignores below
    sm_80), as fp32 training on GPUs usually runs; on any other device nothing changes. Yields whether the flag is on;
    the previous setting comes back on exit.

    Only `torch.backends.cuda.matmul.allow_tf32` is set: `torch.set_float32_matmul_precision` would reach CPU
    backends too, and torch's newer `fp32_precision` may not be mixed with the flag that other code still reads.
    """
    if device.type != "cuda":
        yield False
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def on_tf32(fn: F) -> F:
    """Decorator: `fn`, a benchmark run on the current process group, runs inside `tf32_matmuls(comm_device())`
    (called without a group, it runs as it is and raises its own error)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not dist.is_initialized():
            return fn(*args, **kwargs)
        with tf32_matmuls(comm_device()):
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]



def sync(device: torch.device) -> None:
    """Wait for queued GPU work (CUDA kernels run asynchronously; the host clock would lie)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_clock(device: torch.device) -> float:
    """Line the ranks up (barrier), drain the device, then read the host clock."""
    comm.barrier()
    sync(device)
    return time.perf_counter()


def stop_clock(device: torch.device, t0: float) -> float:
    """Seconds since `t0`, after the device has finished what was queued."""
    sync(device)
    return time.perf_counter() - t0


def slowest_rank(values: list[float], device: torch.device) -> list[float]:
    """Per entry, the maximum over ranks (one all-reduce, outside any timed region): the slowest rank decides."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    comm.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def median(xs: Iterable[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(list(xs)))


def _note(message: str, _said: set[str] = set()) -> None:
    """Warn once per process that a memory figure is degraded on this platform."""
    if message not in _said:
        _said.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window: CUDA allocator peak, or Linux peak RSS (VmHWM) via clear_refs."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5 resets the peak resident set size (Linux >= 4.0)
    except OSError:
        _note("no /proc/self/clear_refs (not Linux): the CPU peak memory is the peak since the process started")


def _proc_status_mb(key: str) -> float | None:
    """A memory line of /proc/self/status (VmHWM, VmRSS, ...) in MB; None where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _psutil_mb(field: str) -> float | None:
    """A field of psutil's memory_info (rss, peak_wset on Windows) in MB; None without psutil or the field."""
    try:
        import psutil
    except ImportError:
        return None
    value = getattr(psutil.Process().memory_info(), field, None)
    return value / 2**20 if value is not None else None


def _rusage_peak_mb() -> float | None:
    """Peak RSS from getrusage in MB: ru_maxrss is in KiB on Linux but in bytes on macOS; None without `resource`."""
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def free_memory(device: torch.device, dropped: Iterable[weakref.ref] = ()) -> None:
    """Return what dropped objects held: collect reference cycles (an engine's hooks point back at it),
    then hand cached CUDA blocks back, so the next measurement starts from what is really in use.

    `dropped`: weak references to what the caller has just let go. When every one is dead already (reference
    counting freed it: no cycle holds it), the collection is skipped. A full collection walks every object the
    process tracks, about 0.28 s in a lesson's rank (some 340,000 objects after its imports). In lesson 05's races,
    all 20 references a rank's calls named were dead, and those collections found nothing, except 10 objects once
    (measured on the 2-core VM); `ddp_rank_bench` collects in full once, before its first measurement.
    """
    refs = list(dropped)
    if not refs or any(ref() is not None for ref in refs):
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory since reset_peak_memory: CUDA max_memory_allocated, or the process's peak RSS on CPU, in MB.

    NaN (with a warning) where the platform gives no peak: no /proc, no `resource`, no psutil."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    for read in (lambda: _proc_status_mb("VmHWM"), _rusage_peak_mb, lambda: _psutil_mb("peak_wset")):
        peak = read()
        if peak is not None:
            return peak
    _note("no way to read the peak memory on this platform (install psutil): peak memory columns read nan")
    return math.nan


def current_memory_mb(device: torch.device) -> float:
    """Memory in use now: CUDA memory_allocated, or the process's resident set size on CPU, in MB (NaN if unknown)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    for read in (lambda: _proc_status_mb("VmRSS"), lambda: _psutil_mb("rss")):
        now = read()
        if now is not None:
            return now
    _note("no way to read the resident memory on this platform (install psutil): memory columns read nan")
    return math.nan


def progress(total: int, desc: str) -> tqdm:
    """A tqdm bar on rank 0 only (other ranks get a disabled one)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    return tqdm(total=total, desc=desc, disable=not rank0, leave=False, dynamic_ncols=True)


class StepClock:
    """Marks inside one step: CUDA events on GPU (they see what the compute stream waited for), host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        """Record a point in time (on the current stream, on GPU)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_s(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]
