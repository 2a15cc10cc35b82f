"""The contract every data-parallel wrapper shares (the DDP engines of lessons 04-05 and lesson 08's FSDP).

`DataParallelWrapper` owns what does not depend on how gradients are synchronized:
- the re-wrap registry: wrapping a module again (a re-run cell) detaches its previous wrapper, which gives the
  module back (its hooks removed; FSDP: its full parameters) and refuses any later use;
- `no_sync()` and the step's state (`Step`): whether the coming backward synchronizes is captured by the forward that
  built its graph, as in torch DDP;
- the forward skeleton: finish what an interrupted backward left in flight, broadcast rank 0's buffers, let the
  engine prepare its synchronization, then run the module;
- queuing the autograd callback that runs when backward ends, and `finish_gradient_synchronization()`;
  the engine supplies `_synchronize()`, the part that differs;
- gradient hooks that hold the wrapper weakly (no parameter -> hook -> wrapper -> module cycle);
- comm accounting of one type: `comm_calls` (an int) and, per collective kind, `comm_calls_by_kind` and
  `comm_bytes`, for the last synchronized step.

It is the hardening under lesson 04's `DDPBase` and lesson 08's `FSDP`, shown in lesson 04's "Under the hood"
appendix.
"""

from __future__ import annotations

import weakref
from collections import Counter
from contextlib import contextmanager, nullcontext
from enum import Enum, auto
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.profiler import record_function

from ddp_lib.comm import Tally, broadcast_coalesced, group_rank0, profiler_on
from ddp_lib.devices import require_process_group

__all__ = ["DataParallelWrapper", "Step", "grad_or_zeros"]


class Step(Enum):
    """Where a wrapper is in its step (FSDP2 keeps one such state per module too: `TrainingState`)."""

    IDLE = auto()  # nothing to synchronize: before the first forward, after finish_gradient_synchronization()
    LOCAL = auto()  # a no_sync() forward ran: its backward accumulates locally
    ARMED = auto()  # a synchronizing forward ran: its backward's gradients are reduced
    REDUCED = auto()  # that backward ended and was synchronized; finish_gradient_synchronization() confirms
    DETACHED = auto()  # a newer wrapper of the same module replaced this one

# module -> weak reference to the wrapper that drives it (any kind: a DDP engine or FSDP); weak both ways
REENTRANT = "reentrant checkpointing? use torch.utils.checkpoint with use_reentrant=False"

_WRAPPER_OF: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


class DataParallelWrapper(nn.Module):
    """Base of every DDP engine and of FSDP: one wrapper of `module` at a time, synchronized at backward's end.

    Subclasses set `self.sync_group` (the ranks gradients and buffers are shared over), call `self._register()`
    once built, and supply `_synchronize()`; they may override the hooks documented below.
    After a synchronized step, `comm_calls` is the number of collectives that moved parameters or gradients
    in it (buffer broadcasts and bookkeeping excluded), `comm_calls_by_kind` and `comm_bytes` the same per
    collective kind ("all_reduce", "all_gather", "reduce_scatter") with their payload bytes.
    """

    def __init__(self, module: nn.Module, broadcast_buffers: bool = True, *, label: str | None = None,
                 detached_advice: str = ""):
        super().__init__()
        require_process_group()
        previous = _WRAPPER_OF.get(module)
        if previous is not None and previous() is not None and previous().step is not Step.DETACHED:
            previous().detach()  # a re-run cell: the old wrapper gives the module back first
        self.module = module
        self.sync_group = None
        self.buffers_to_sync = list(module.buffers()) if broadcast_buffers else []
        self._grad_sync = True  # the setting no_sync() toggles; the forward turns it into the step's state
        self.step = Step.IDLE
        self._callback_queued = False  # the end-of-backward callback of the running backward is queued
        self._hooks: list = []  # every hook this wrapper registered; removed on detach or collection
        weakref.finalize(self, _remove_all, self._hooks)
        self._tally = Tally()  # what ddp_lib.comm counted for this wrapper (its parts hold it too), never reset
        # (calls, bytes) as the tally stood when the last two synchronized steps ended: comm_calls* is the difference
        self._marks: tuple[tuple[Counter, Counter], ...] = ((Counter(), Counter()),) * 2
        self._label = label or type(self).__name__  # the profiler's name of its synchronization: ddp.<label>.<where>
        self._detached_advice = detached_advice  # what else a user of a detached wrapper must do

    def _register(self) -> None:
        """This wrapper now drives its module: a later wrapper of the same module detaches it."""
        _WRAPPER_OF[self.module] = weakref.ref(self)

    # ------------------------------------------------------------------ forward, no_sync, finish
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; remember whether the coming backward synchronizes."""
        self._before_forward()
        self._callback_queued = False  # an interrupted backward never ran its callback: the next one must
        if self._grad_sync:
            self._begin_sync()
        self.step = Step.ARMED if self._grad_sync else Step.LOCAL
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: forward/backward only accumulate gradients locally; the next synchronized step reduces the sum."""
        previous, self._grad_sync = self._grad_sync, False
        try:
            yield
        finally:
            self._grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Block until every rank holds the rank-averaged gradients (a no-op after a no_sync forward).

        Engines that synchronize when backward ends (OverlapDDP, BucketedDDP, FSDP) already did; then this
        only confirms.
        """
        if not self._should_sync():
            return
        if self.step is Step.ARMED:
            self._sync_now("finish")
        self.step = Step.IDLE

    def _before_forward(self) -> None:
        """Refuse an unusable wrapper; finish whatever an interrupted backward left in flight."""
        self._check_usable()
        self._land_in_flight()

    def _check_usable(self) -> None:
        if self.step is Step.DETACHED:
            raise RuntimeError(f"this {type(self).__name__} was detached: a newer wrapper of the same module "
                               f"replaced it (a re-run cell?); use the new wrapper{self._detached_advice}")

    def _begin_sync(self) -> None:
        """A synchronizing step's collectives before the module runs, in one order on every rank."""
        if self.buffers_to_sync:
            broadcast_coalesced(self.buffers_to_sync, group_rank0(self.sync_group), self.sync_group)
        self._prepare_sync()

    # ------------------------------------------------------------------ backward's end
    def _should_sync(self) -> bool:
        """Whether gradients arriving now are to be reduced; a clear error if the forward bypassed the wrapper."""
        if self.step in (Step.LOCAL, Step.DETACHED):
            return False
        if self.step is Step.IDLE:
            raise RuntimeError(
                f"{type(self).__name__}: gradients to synchronize without a forward through the wrapper: "
                "call ddp(x), not ddp.module(x), and finish_gradient_synchronization() once per backward")
        return True

    def _grad_arrived(self, p: nn.Parameter, k: int) -> None:
        """A hooked gradient arrived: decided here, once, whether it is reduced; then handed down to the engine."""
        if self.step is not Step.ARMED:  # the usual case (ARMED) costs one comparison: this runs per gradient
            if not self._should_sync():
                return
            raise RuntimeError(  # REDUCED: _should_sync refused LOCAL/DETACHED and raised on IDLE
                "a gradient arrived after this backward was already synchronized: a nested backward ended first "
                f"({REENTRANT}), or backward ran twice on one forward (run one backward per forward)")
        if not self._callback_queued:
            self._queue_end_of_backward()
        self._on_grad_ready(p, k)

    def _queue_end_of_backward(self) -> None:
        """Run `_end_of_backward` once autograd has run out of work in the current backward (queued once).

        Synchronizing when backward ends (as torch DDP does) means no later forward/backward, e.g. a
        no_sync() step after a forgotten finish, can ever accumulate into a gradient still being reduced.
        The callback holds the wrapper weakly, as the gradient hooks do: a callback that autograd still holds after
        a backward keeps no dropped wrapper alive through it. (A bound method would; lesson 05's model was found
        alive right after `del` and `gc.collect()` on simulated GPU ranks, 2 times in 8 runs before this change.)
        """
        if not self._callback_queued:
            wrapper = weakref.ref(self)

            def _end_of_backward() -> None:
                w = wrapper()
                if w is not None:
                    w._end_of_backward()

            torch.autograd.Variable._execution_engine.queue_callback(_end_of_backward)
            self._callback_queued = True

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self.step not in (Step.LOCAL, Step.DETACHED):
            self._sync_now("end_of_backward")

    def _sync_now(self, where: str) -> None:
        # torch's label, not watch.traced: the landing enters watch from comm only (tests/test_gradient_walk.py)
        with record_function(f"ddp.{self._label}.{where}") if profiler_on() else nullcontext():
            self._synchronize()
        self.step = Step.REDUCED
        # publish the step's count: a copy of the tally's totals (read, not called: nothing below is entered again)
        self._marks = (self._marks[1], (Counter(self._tally.calls), Counter(self._tally.bytes)))

    # ------------------------------------------------------------------ comm accounting
    @property
    def comm_calls_by_kind(self) -> dict[str, int]:
        """Collectives per kind ("all_reduce", "all_gather", "reduce_scatter") of the last synchronized step (its
        no_sync steps and forward included: all counted since the synchronized step before it)."""
        (before, _), (after, _) = self._marks
        return {kind: n - before[kind] for kind, n in after.items() if n > before[kind]}

    @property
    def comm_bytes(self) -> dict[str, int]:
        """Payload bytes per kind, counted as `comm_calls_by_kind` (the same kinds, zero-size payloads included)."""
        (_, before), (_, after) = self._marks
        return {kind: after[kind] - before[kind] for kind in self.comm_calls_by_kind}

    @property
    def comm_calls(self) -> int:
        """Collectives that moved parameters or gradients in the last synchronized step (0 before the first)."""
        return sum(self.comm_calls_by_kind.values())

    @contextmanager
    def _uncounted(self) -> Iterator[None]:
        """Inside: collectives are counted apart and dropped (a step that is not this rank's own, e.g. a shadow)."""
        kept, self._tally = self._tally, Tally()
        try:
            yield
        finally:
            self._tally = kept

    # ------------------------------------------------------------------ hooks and detach
    def register_grad_hooks(self, params: list[nn.Parameter]) -> None:
        """Call `self._on_grad_ready(p, k)` after backward accumulates the gradient of `p = params[k]`, when the
        step reduces it (`_grad_arrived` decides, and queues the end-of-backward synchronization).

        The hooks hold the wrapper weakly (no parameter -> hook -> wrapper -> module cycle keeps a
        dropped wrapper alive), and are removed when the wrapper is detached or collected.
        """
        wrapper = weakref.ref(self)

        def hook_for(k: int):
            def hook(p: nn.Parameter) -> None:
                w = wrapper()
                if w is not None:
                    w._grad_arrived(p, k)
            return hook

        self._hooks.extend(p.register_post_accumulate_grad_hook(hook_for(k)) for k, p in enumerate(params))

    def detach(self) -> None:
        """Give the module back (its hooks removed, in-flight work finished); the wrapper can no longer be used."""
        self._land_in_flight()
        _remove_all(self._hooks)
        self._hooks.clear()
        self.step = Step.DETACHED

    # ------------------------------------------------------------------ what engines supply
    def _synchronize(self) -> None:
        """Make every trainable gradient the rank average (collectives through ddp_lib.comm, tally=self._tally)."""
        raise NotImplementedError

    def _prepare_sync(self) -> None:
        """Called by a synchronizing forward, before the module runs."""

    def _on_grad_ready(self, p: nn.Parameter, k: int) -> None:
        """Hook engines override this: a gradient to reduce in this backward (k: its index in the hooked list); it
        runs once per parameter per synchronizing backward, and never needs to call back into the wrapper."""

    def _land_in_flight(self) -> None:
        """Finish collectives an interrupted backward left running (before a forward, and on detach)."""


def grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    """The local gradient, installed as `.grad`: zeros when this rank produced none (it still takes part in the
    collective, or its peers would hang), made contiguous if not (gloo and NCCL reduce only contiguous tensors, and
    a parameter made from a transposed view gets a gradient with the same strides; a contiguous `.grad` is as good
    to autograd, which accumulates into it in place, and to the optimizer)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
    elif not p.grad.is_contiguous():
        p.grad = p.grad.contiguous()
    return p.grad


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
