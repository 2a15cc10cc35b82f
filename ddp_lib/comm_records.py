"""What the collectives layer (`ddp_lib.comm`) records about itself, and who may watch it.

- `KINDS`: the one list of torch.distributed calls that involve peers, with how a checker compares each across
  ranks; `resolve(name)` looks one up in torch.distributed when called;
- `observe()`: observers told of every collective the layer issues (a checker's guard registers here);
- `Tally`: calls and payload bytes per kind, a wrapper's running totals (its `comm_calls` is a step's difference);
- profiler labels: `traced(name)` (a `record_function` only while a profiler records) and `phase(name)` (also an
  NVTX range on GPUs, and CUDA-event timing inside `ddp_lib.kit.profiling.profile_steps`);
- spies for tests and lessons: `count_traffic()` and `spy_on()` wrap torch.distributed's own functions.

It sits below `ddp_lib.comm` and `ddp_lib.kit.profiling`, and imports neither: the layers only go down.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.profiler import record_function

from ddp_lib.devices import ranks_use_cuda

#: every torch.distributed call that involves peers, by how a checker compares it across ranks: "strict" (shapes,
#: dtypes, reduce op and source must agree), "loose" (shapes may differ per rank: the name only), "p2p" (one
#: partner: never compared)
KINDS: dict[str, str] = {
    **dict.fromkeys(("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                     "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "barrier"), "strict"),
    **dict.fromkeys(("all_to_all", "all_to_all_single", "gather", "scatter", "all_gather_object",
                     "broadcast_object_list", "gather_object", "scatter_object_list"), "loose"),
    **dict.fromkeys(("send", "recv", "isend", "irecv", "batch_isend_irecv"), "p2p"),
}
COLLECTIVES = tuple(n for n, k in KINDS.items() if k != "p2p")
P2P = tuple(n for n, k in KINDS.items() if k == "p2p")
SENDING = ("send", "isend")  # the point-to-point calls whose first tensor leaves this rank
#: torch 2.13 names the flat collectives *_single and deprecates the older names that torch>=2.4 has
RENAMED = {"all_gather_into_tensor": "all_gather_single", "reduce_scatter_tensor": "reduce_scatter_single"}

#: the attribute of torch.distributed each name is looked up under (torch 2.13's new name where this torch has it)
_ATTR = {n: RENAMED[n] if hasattr(dist, RENAMED.get(n, "")) else n for n in KINDS}


def resolve(name: str) -> Callable:
    """`torch.distributed.<name>` now (torch 2.13's new name where it exists): whatever is installed there runs."""
    return getattr(dist, _ATTR[name])


class Observer(Protocol):
    """Told of every collective the layer issues, before it runs (`observe()` registers one)."""

    compares_every_call: bool  # a checker's guard that compares every collective across ranks itself

    def before_collective(self, kind: str, payload: torch.Tensor | None, group: Any, label: str | None) -> None: ...


OBSERVERS: list[Observer] = []  # read by ddp_lib.comm before each collective


@contextlib.contextmanager
def observe(observer: Observer) -> Iterator[Observer]:
    """Inside: `observer.before_collective(...)` runs before each collective the layer issues."""
    OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        OBSERVERS.remove(observer)


def compared() -> bool:
    """Whether an observer compares every collective across ranks (a checker's guard is installed)."""
    return any(o.compares_every_call for o in OBSERVERS)


class Tally:
    """Collectives counted for one wrapper: calls and payload bytes per kind, added up and never reset (a wrapper
    publishes a step's count as the difference of two copies of its totals)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def add(self, kind: str, payload: torch.Tensor) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += payload.numel() * payload.element_size()

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Inside: collectives are counted, then dropped (a step that is not this rank's own, e.g. join's shadow)."""
        calls, nbytes = Counter(self.calls), Counter(self.bytes)
        try:
            yield
        finally:
            self.calls, self.bytes = calls, nbytes


# ------------------------------------------------------------------ profiler labels
class DeviceClock:
    """CUDA events around each `phase` while `profile_steps` runs on CUDA ranks: the host returns from an
    asynchronous launch (a fused optimizer, a stream-side NCCL wait) long before the GPU has done it."""

    def __init__(self) -> None:
        self.pending: list[tuple[str, Any, Any]] = []
        self.total_ms: dict[str, float] = {}

    def settle(self, keep: bool) -> None:
        """After a device synchronize: add the step's (start, end) pairs to the totals, or drop them."""
        for name, start, end in self.pending if keep else ():
            self.total_ms[name] = self.total_ms.get(name, 0.0) + start.elapsed_time(end)
        self.pending.clear()


clock: DeviceClock | None = None  # set only inside ddp_lib.kit.profiling.profile_steps on CUDA ranks

profiler_on: Callable[[], bool] = torch._C._autograd._profiler_enabled  # whether a torch profiler records now


def traced(name: str) -> contextlib.AbstractContextManager:
    """`record_function(name)` while a torch profiler records, else nothing: entering one is a dispatcher call
    whatever the profiler's state, and the engines label every bucket and step."""
    return record_function(name) if profiler_on() else contextlib.nullcontext()


_CUDA_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # default group -> whether its ranks use CUDA


def _ranks_use_cuda() -> bool:
    """`ranks_use_cuda()`, asked once per default process group: a phase labels every step's wait, and the answer
    only changes with the group (held weakly: destroy_process_group() must still free it)."""
    if not dist.is_initialized():
        return ranks_use_cuda()
    world = c10d._get_default_group()
    use = _CUDA_OF.get(world)
    if use is None:
        use = _CUDA_OF[world] = ranks_use_cuda()
    return use


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label a region for torch.profiler (and Nsight Systems via NVTX when CUDA is there); inside
    `profile_steps` on CUDA ranks, also time it on the device with CUDA events."""
    nvtx, timer = _ranks_use_cuda(), clock
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    if timer is not None:
        start = torch.cuda.Event(enable_timing=True)
        start.record()  # on the current stream: the time the stream reaches this point, not the host
    try:
        with traced(name):
            yield
    finally:
        if timer is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            timer.pending.append((name, start, end))
        if nvtx:
            torch.cuda.nvtx.range_pop()


# ------------------------------------------------------------------ spies for tests and lessons
class Traffic:
    """What the calls made inside `count_traffic()` sent: bytes by point-to-point, and collective calls by name."""

    def __init__(self) -> None:
        self.sent_bytes = 0
        self.sends = 0
        self.collectives: dict[str, int] = {}


@contextlib.contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count bytes sent with dist.send/isend (batch_isend_irecv included) and every collective called, on this rank.

    Both `torch.distributed` and `torch.distributed.distributed_c10d` get the counting wrappers, so that a
    `P2POp(dist.isend, ...)` built inside the block passes torch's own check of its op and is counted when run.
    """
    seen = Traffic()
    modules = (dist, c10d)
    originals = {name: getattr(c10d, name) for name in SENDING + COLLECTIVES if hasattr(c10d, name)}

    def sending(real: Callable) -> Callable:
        def wrapper(tensor, *args, **kwargs):
            seen.sent_bytes += tensor.numel() * tensor.element_size()
            seen.sends += 1
            return real(tensor, *args, **kwargs)
        return wrapper

    depth = [0]  # a collective built from others (all_gather_object) counts once, as the call made

    def collective(name: str, real: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            if depth[0] == 0:
                seen.collectives[name] = seen.collectives.get(name, 0) + 1
            depth[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapper

    for name, real in originals.items():
        wrapped = sending(real) if name in SENDING else collective(name, real)
        for module in modules:
            setattr(module, name, wrapped)
    try:
        yield seen
    finally:
        for name, real in originals.items():
            for module in modules:
                setattr(module, name, real)


@contextlib.contextmanager
def spy_on(name: str, on_call: Callable[..., None]) -> Iterator[None]:
    """Inside: each `torch.distributed.<name>(...)` first calls `on_call` with the same arguments, then the real
    collective runs and its result is returned; restored on leaving, also on an error. The tests' and checkers'
    one way to watch what reaches a collective (`count_traffic` counts every collective and send)."""
    real = getattr(dist, name)

    def spy(*args, **kwargs):
        on_call(*args, **kwargs)
        return real(*args, **kwargs)

    setattr(dist, name, spy)
    try:
        yield
    finally:
        setattr(dist, name, real)
