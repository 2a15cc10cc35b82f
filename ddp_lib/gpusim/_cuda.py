"""`torch.cuda` as on a box of the profile's GPUs: devices, properties, memory, events, streams, synchronize.

Factories that name a CUDA device (`torch.empty(..., device="cuda")`, and every op built on `empty`/`empty_strided`:
zeros, randn, `.to("cuda")`, the DDP reducer's buckets) reach the CUDA dispatch key; `torch.library` gives that
key kernels that allocate on the CPU, after checking the profile's memory, and return simulated tensors.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from ddp_lib.gpusim import _box, _dry, _memory
from ddp_lib.gpusim._box import check_index
from ddp_lib.gpusim._tensor import SimCudaTensor, _unwrap


@dataclass(frozen=True)
class DeviceProperties:
    """What torch.cuda.get_device_properties answers on the profile's GPU."""

    name: str
    total_memory: int
    major: int
    minor: int
    multi_processor_count: int
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    L2_cache_size: int = 50 * 2**20


_syncs = 0  # how many times the host waited for the devices (torch.cuda.synchronize, Event/Stream.synchronize)


def _index(device=None) -> int:
    if device is None:
        return _box.current
    if isinstance(device, int):
        return check_index(device)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {device}")
    return check_index(device.index)


def current_device() -> int:
    """torch.cuda.current_device."""
    return _box.current


def set_device(device) -> None:
    """torch.cuda.set_device."""
    _box.current = _index(device)


# torch.cuda._sleep's cycles per second: a simulated GPU spins at 1 GHz (what a check uses to keep a device busy)
SLEEP_HZ = 1.0e9
_busy_until: dict[int, float] = {}  # when each GPU finishes the spins queued on it (host clock)


def sleep(cycles: int) -> None:
    """torch.cuda._sleep: the current GPU spins for `cycles`; the host goes on."""
    index = _box.current
    _busy_until[index] = max(time.perf_counter(), _busy_until.get(index, 0.0)) + cycles / SLEEP_HZ


def _reached(index: int) -> float:
    """The host clock at which GPU `index` has done all it was given (collectives in flight waited for)."""
    _box.drain()
    return max(time.perf_counter(), _busy_until.get(index, 0.0))


def synchronize(device=None) -> None:
    """The host waits for the device: its collectives in flight and its spins; then counted (SimWork.is_completed)."""
    global _syncs
    index = _index(device)
    until = _reached(index)
    while (left := until - time.perf_counter()) > 0:
        time.sleep(left)
    _syncs += 1


class Event:
    """torch.cuda.Event: its time is when the device reaches it (the host clock, after the collectives in flight and
    the spins queued before `record`); ops themselves run synchronously on the host."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing, self._t, self._index = enable_timing, None, 0

    def record(self, stream=None) -> None:
        """Record on the stream: reached once what was queued before is done."""
        self._index = stream.device_index if stream is not None else _box.current
        self._t = _reached(self._index)

    def wait(self, stream=None) -> None:
        """Make a stream wait: nothing to wait for."""

    def query(self) -> bool:
        """Whether the device has reached the event."""
        return self._t is None or time.perf_counter() >= self._t

    def synchronize(self) -> None:
        """The host waits for the event."""
        global _syncs
        while self._t is not None and (left := self._t - time.perf_counter()) > 0:
            time.sleep(left)
        _syncs += 1

    def elapsed_time(self, end: "Event") -> float:
        """Milliseconds between two recorded events, as CUDA requires both recorded with timing enabled and done."""
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._t is None or end._t is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self.query() and end.query()):
            raise RuntimeError("CUDA error: device not ready")
        return (end._t - self._t) * 1000.0


class Stream:
    """torch.cuda.Stream: work is issued and finished in program order, so waits are no-ops."""

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:  # noqa: ARG002
        self.device = torch.device("cuda", _index(device))
        self.device_index, self.priority = self.device.index, priority

    def wait_stream(self, stream) -> None:
        """Nothing outstanding to wait for."""

    def wait_event(self, event) -> None:
        """Nothing outstanding to wait for."""

    def record_event(self, event=None) -> Event:
        """Record an event now."""
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        """The stream is idle."""
        return True

    def is_capturing(self) -> bool:
        """No CUDA graph is being captured (torch's optimizers ask every step)."""
        return False

    def synchronize(self) -> None:
        """The host waits for the stream."""
        synchronize()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


_streams: dict[int, Stream] = {}


def current_stream(device=None) -> Stream:
    """torch.cuda.current_stream / default_stream: one stream per device."""
    index = _index(device)
    if index not in _streams:
        _streams[index] = Stream(index)
    return _streams[index]


@contextlib.contextmanager
def stream(s=None):
    """torch.cuda.stream: run the block on `s` (all streams run in order here)."""
    yield s


def get_device_properties(device=None) -> DeviceProperties:
    """torch.cuda.get_device_properties from the profile."""
    _index(device)
    p = _box.profile
    return DeviceProperties(p.name, p.total_memory, p.major, p.minor, p.multi_processor_count)


def memory_allocated(device=None) -> int:
    """Bytes held by live tensors on the device."""
    return _memory.current(_index(device))


def max_memory_allocated(device=None) -> int:
    """The peak since the start or the last reset_peak_memory_stats."""
    return _memory.highest(_index(device))


def reset_peak_memory_stats(device=None) -> None:
    """Restart the peak from what is allocated now."""
    _memory.reset_peak(_index(device))


def mem_get_info(device=None) -> tuple[int, int]:
    """(free, total) bytes of the device."""
    return _box.profile.total_memory - memory_allocated(device), _box.profile.total_memory


def memory_stats(device=None) -> dict[str, int]:
    """The allocator counters the course reads."""
    index = _index(device)
    return {"allocated_bytes.all.current": _memory.current(index),
            "allocated_bytes.all.peak": _memory.highest(index),
            "reserved_bytes.all.current": _memory.current(index),
            "reserved_bytes.all.peak": _memory.highest(index)}


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    index = check_index(torch.device(device).index if device is not None else None)
    dtype = dtype or torch.get_default_dtype()
    numel = 1
    for s in size:
        numel *= int(s)
    _memory.check(index, numel * dtype.itemsize)
    meta = _dry.enabled and numel * dtype.itemsize > _dry.threshold  # dry mode: a large tensor holds no data
    inner = torch.empty(size, dtype=dtype, layout=layout, memory_format=memory_format,
                        device="meta" if meta else None)
    return SimCudaTensor(inner, torch.device("cuda", index))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    index = check_index(torch.device(device).index if device is not None else None)
    dtype = dtype or torch.get_default_dtype()
    nbytes = (1 + sum((int(n) - 1) * int(s) for n, s in zip(size, stride) if int(n))) * dtype.itemsize
    _memory.check(index, nbytes)
    meta = _dry.enabled and nbytes > _dry.threshold  # dry mode: a large tensor holds no data
    inner = torch.empty_strided(size, stride, dtype=dtype, layout=layout, device="meta" if meta else None)
    return SimCudaTensor(inner, torch.device("cuda", index))


def _copy_kernel(self, src, non_blocking: bool = False):
    # copy_ is CompositeExplicitAutograd: its CUDA entry would reach the missing CUDA copy stub
    from ddp_lib.gpusim._special import _copy

    return _copy(torch.ops.aten.copy_.default, (self, src, non_blocking), {})


def _fallback(op, *args, **kwargs):
    # an op that reaches the CUDA key itself (code that excluded the Python key, as torch.tensor(..., device=) does)
    return SimCudaTensor.__torch_dispatch__(op, (), args, kwargs)


_libs: list = []


def register_factories() -> None:
    """Give the CUDA dispatch key kernels: the two allocations every CUDA factory ends in, copy_, and a fallback."""
    if _libs:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _empty, "CUDA")
    lib.impl("empty_strided", _empty_strided, "CUDA")
    lib.impl("copy_", _copy_kernel, "CUDA")
    every = torch.library.Library("_", "IMPL")
    every.fallback(_fallback, "CUDA")
    _libs.extend([lib, every])
