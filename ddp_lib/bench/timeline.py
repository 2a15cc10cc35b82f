"""Lesson 05's timeline of one DDP step: forward, backward's compute, and every all-reduce, measured on the rank.

Two clocks, one interface (`Marks`):
- CPU / gloo: the host clock. An async all-reduce's completion is stamped by a callback on its Work's future,
  which gloo completes when the reduction is done.
- GPU / NCCL: CUDA events. Under NCCL a Work's future is CUDA-aware: it completes once later kernels *can be
  ordered after* the collective, i.e. at enqueue time, so a host callback would make every all-reduce look
  instantaneous. Instead a side stream is made to wait for the collective (`work.wait()` on it makes that stream,
  not the host, wait) and an event recorded there fires when the NCCL kernel has finished. The end of backward's
  compute is an event on the compute stream, never `torch.cuda.synchronize()`, which also waits for NCCL's stream.
Times are read (host sync) only after the step, as milliseconds since the step's first mark.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddp_lib import comm
from ddp_lib.bench.timing import on_tf32


class Marks:
    """Points in time on one rank: CUDA events on a chosen stream (GPU) or host clock readings (CPU)."""

    def __init__(self, device: torch.device, clock: Callable[[], float] = time.perf_counter):
        self.cuda = device.type == "cuda"
        self.clock = clock
        self.origin: Any = None
        self.pending: list = []  # futures of completion callbacks still to run (CPU)

    def now(self, stream: "torch.cuda.Stream | None" = None) -> Any:
        """A mark: on GPU an event recorded on `stream` (default: the current, compute stream)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            mark = event
        else:
            mark = self.clock()
        if self.origin is None:
            self.origin = mark
        return mark

    def ms(self, mark: Any) -> float | None:
        """Milliseconds from the first mark to `mark` (None: not reached). On GPU call after the work is done."""
        if mark is None:
            return None
        if self.cuda:
            return self.origin.elapsed_time(mark)
        return (mark - self.origin) * 1e3

    def settle(self) -> None:
        """Before reading marks: wait for every event recorded (GPU), or for every completion callback (CPU: a
        Work's future may run its callbacks on the backend's thread just after `wait()` has returned)."""
        if self.cuda:
            torch.cuda.synchronize()  # after the step, so it measures nothing: every stream, NCCL's included
        for fut in self.pending:
            fut.wait()
        self.pending = []


def stamp(marks: Marks, work, label: str, records: list) -> list:
    """Record a collective's launch now, and its completion when it really completes; return its record
    [label, launch mark, completion mark or None until then]."""
    rec = [label, marks.now(), None]
    records.append(rec)
    if marks.cuda:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            work.wait()  # NCCL: makes the side stream (not the host) wait for the collective's kernel
        rec[2] = marks.now(side)
    else:
        marks.pending.append(work.get_future().then(lambda fut: rec.__setitem__(2, marks.now())))
    return rec


def timed_engine(cls: type) -> type:
    """A subclass of a DDP engine that stamps its all-reduces and the start of its synchronization."""

    class Timed(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if hasattr(self.sync, "launch"):  # OverlapDDP, BucketedDDP: one async all-reduce per launch
                self.sync.launch = _stamped(self.sync, self.sync.launch, weakref.ref(self))

        def _synchronize(self) -> None:  # naive: in finish; hook engines: in the end-of-backward callback
            self.t_sync = self.marks.now()  # backward's compute is done (GPU: an event on the compute stream)
            if hasattr(self.sync, "launch"):
                return super()._synchronize()
            rec = ["all, blocking", self.t_sync, None]
            self.comm.append(rec)
            super()._synchronize()
            rec[2] = self.marks.now()

    Timed.__name__ = Timed.__qualname__ = f"Timed{cls.__name__}"
    return Timed


def _stamped(sync, launch: Callable, ddp: weakref.ref) -> Callable:
    """`sync.launch`, stamping each collective it starts into the engine's marks."""

    def stamped(item):
        work = launch(item)
        stamp(ddp().marks, work, f"c{sync.next - 1}", ddp().comm)
        return work

    return stamped


@on_tf32  # the race's compute speed (ddp_step.ddp_rank_bench), so the picture and the race agree
def step_timeline(make_ddp: Callable, workload, device: torch.device, steps: int = 3, seed: int = 0) -> dict:
    """Train `steps` steps of `workload` through `make_ddp(model)` (a timed engine) and return the last one's
    marks in ms: fwd, bwd (backward's compute ended), backward_returns, end, comm [(label, launch, done)], calls."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    with torch.device(device):
        model = workload.build()
    ddp = make_ddp(model)
    batch = tuple(t.chunk(ws)[rank].to(device)
                  for t in workload.batch(torch.Generator().manual_seed(seed + 1), workload.default_batch))
    for _ in range(steps):  # the last step is kept; the first ones warm up
        ddp.marks, ddp.comm = Marks(device), []
        model.zero_grad(set_to_none=False)
        comm.barrier()
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the compute stream only: start from an idle rank
        t0 = ddp.marks.now()
        loss = workload.loss(ddp, batch)
        t_fwd = ddp.marks.now()
        loss.backward()
        t_bwd = ddp.marks.now()
        ddp.finish_gradient_synchronization()
        t_end = ddp.marks.now()
        ddp.marks.settle()
    m = ddp.marks.ms
    out = dict(engine=type(ddp).__name__.removeprefix("Timed"), fwd=m(t_fwd), bwd=min(m(ddp.t_sync), m(t_bwd)),
               backward_returns=m(t_bwd), end=m(t_end), start=m(t0), calls=ddp.comm_calls,
               comm=[(label, m(a), m(b)) for label, a, b in ddp.comm])
    del ddp, model
    return out
