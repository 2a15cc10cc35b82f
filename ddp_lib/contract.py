"""The front every data-parallel wrapper is: one nn.Module holding the contract, a sync strategy doing the rest.

`DataParallelWrapper` owns what does not depend on how gradients are synchronized:
- the re-wrap registry: wrapping a module again (a re-run cell) detaches its previous wrapper, which gives the
  module back (its hooks removed; FSDP: its full parameters) and refuses any later use;
- `no_sync()` and the step's state (`Step`): whether the coming backward synchronizes is captured by the forward that
  built its graph, as in torch DDP;
- the forward: finish what an interrupted backward left in flight, broadcast rank 0's buffers, let the strategy
  prepare, then run the module;
- the autograd callback that runs when backward ends, and `finish_gradient_synchronization()`;
- gradient hooks that hold the wrapper weakly (no parameter -> hook -> wrapper -> module cycle);
- a DDP engine's construction (`strategy=`): rank 0's parameters and buffers broadcast, the trainable parameters
  listed, and a forward that refuses when `requires_grad` changed since; `join()` for uneven inputs;
- comm accounting of one type: `comm_calls` (an int) and, per collective kind, `comm_calls_by_kind` and
  `comm_bytes`, for the last synchronized step.

A DDP engine hands the front a strategy (`ddp_lib/ddp/strategy.py`), and in a step the front calls only its verbs:
`prepare()` at a synchronizing forward, `on_grad(p, k)` for each hooked gradient to reduce, `finish()` when backward
ends, `land()` before a forward or a detach; `hooked` names the parameters it wants to hear about (under `join()`,
also `wants_setup()` and `join_part()`). FSDP, whose synchronization is its units', extends the front instead and
overrides `_before_forward`, `_end_of_backward`, `_synchronize` and `_land_in_flight`. Lesson 04's "Under the hood"
appendix shows this file.
"""

from __future__ import annotations

import weakref
from collections import Counter
from contextlib import contextmanager, nullcontext
from enum import Enum, auto
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from ddp_lib.comm import (Tally, WeakGroup, broadcast_coalesced, broadcast_module_state, group_rank0,
                           profiler_on)
from ddp_lib.devices import require_process_group

__all__ = ["DataParallelWrapper", "Step", "REENTRANT"]


class Step(Enum):
    """Where a wrapper is in its step (FSDP2 keeps one such state per module too: `TrainingState`)."""

    IDLE = auto()  # nothing to synchronize: before the first forward, after finish_gradient_synchronization()
    LOCAL = auto()  # a no_sync() forward ran: its backward accumulates locally
    ARMED = auto()  # a synchronizing forward ran: its backward's gradients are reduced
    REDUCED = auto()  # that backward ended and was synchronized; finish_gradient_synchronization() confirms
    DETACHED = auto()  # a newer wrapper of the same module replaced this one


REENTRANT = "reentrant checkpointing? use torch.utils.checkpoint with use_reentrant=False"

# module -> weak reference to the wrapper that drives it (any kind: a DDP engine or FSDP); weak both ways
_WRAPPER_OF: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


class DataParallelWrapper(nn.Module):
    """The front of every DDP engine and of FSDP: one wrapper of `module` at a time, synchronized at backward's end.

    A DDP engine passes `strategy=` (called with the module, its trainable parameters, the group, the tally and the
    buffers to broadcast) and `process_group=`. FSDP passes neither, sets `self.sync_group`, and overrides the
    synchronization methods.
    Either calls `self._register()` once built. After a synchronized step, `comm_calls` is the number of collectives
    that moved parameters or gradients in it (buffer broadcasts and bookkeeping excluded), `comm_calls_by_kind` and
    `comm_bytes` the same per collective kind ("all_reduce", "all_gather", "reduce_scatter") with payload bytes.
    """

    sync = None  # the strategy of a DDP engine
    # held weakly, so that destroy_process_group() frees them (ddp_lib.comm.WeakGroup)
    process_group, sync_group = WeakGroup(), WeakGroup()
    _join = None  # join()'s state while inside it (ddp_lib/ddp/join.py)

    def __init__(self, module: nn.Module, broadcast_buffers: bool = True, *, label: str | None = None,
                 detached_advice: str = "", strategy: Callable | None = None, process_group=None):
        super().__init__()
        require_process_group()
        previous = _WRAPPER_OF.get(module)
        if previous is not None and previous() is not None and previous().step is not Step.DETACHED:
            previous().detach()  # a re-run cell: the old wrapper gives the module back first
        self.module = module
        self.sync_group = process_group
        self.buffers_to_sync = list(module.buffers()) if broadcast_buffers else []
        self._grad_sync = True  # the setting no_sync() toggles; the forward turns it into the step's state
        self.step = Step.IDLE
        self._callback_queued = False  # the end-of-backward callback of the running backward is queued
        self._hooks: list = []  # every hook this wrapper registered; removed on detach or collection
        weakref.finalize(self, _remove_all, self._hooks)
        self._tally = Tally()  # what ddp_lib.comm counted for this wrapper, never reset (its parts hold it too)
        # (calls, bytes) as the tally stood when the last two synchronized steps ended: comm_calls* is the difference
        self._marks: tuple[tuple[Counter, Counter], ...] = ((Counter(), Counter()),) * 2
        self._label = label or type(self).__name__  # the profiler's name of its synchronization: ddp.<label>.<where>
        self._detached_advice = detached_advice  # what else a user of a detached wrapper must do
        if strategy is not None:
            self.process_group, self.world_size = process_group, dist.get_world_size(process_group)
            broadcast_module_state(module, process_group)  # replicas start as rank 0's, whatever the seeds
            # module.parameters() yields a tied parameter once: it is reduced once
            self.trainable = [p for p in module.parameters() if p.requires_grad]
            self._frozen = [p for p in module.parameters() if not p.requires_grad]
            self.sync = strategy(module, self.trainable, process_group, self._tally, self.buffers_to_sync)
            self.register_grad_hooks(self.sync.hooked)
            self._register()

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
        """Refuse an unusable wrapper; land what an interrupted backward left in flight; a DDP engine also checks
        its trainable parameters and, inside join(), agrees on who still has data."""
        self._check_usable()
        self._land_in_flight()
        if self.sync is not None:
            self._check_trainable_unchanged()
            if self._join is not None and self._grad_sync:
                active, self.sync.setup_due = self._join.agree(True, self.sync.wants_setup())
                self.sync.divide_by = self._join.divisor(active)

    def _check_usable(self) -> None:
        if self.step is Step.DETACHED:
            raise RuntimeError(f"this {type(self).__name__} was detached: a newer wrapper of the same module "
                               f"replaced it (a re-run cell?); use the new wrapper{self._detached_advice}")

    def _check_trainable_unchanged(self) -> None:
        """Fail loudly, as torch DDP does, when requires_grad changed after wrapping.

        The engines plan their all-reduces (and buckets, and hooks) from the parameters that required gradients at
        construction. One frozen later would still get a (zero) gradient, which AdamW's weight decay and momentum
        turn into updates; one unfrozen later would never be averaged and the replicas would drift apart. Both are
        silent, so the forward refuses: wrap again. It reads the flag of each parameter the module had when wrapped
        (a walk of the module tree at every forward would cost more than the rest of the forward's bookkeeping);
        a parameter added later is not seen.
        """
        if all(p.requires_grad for p in self.trainable) and not any(p.requires_grad for p in self._frozen):
            return
        was = {id(p) for p in self.trainable}
        is_ = {id(p) for p in self.module.parameters() if p.requires_grad}
        names = {id(p): n for n, p in self.module.named_parameters()}
        raise RuntimeError(
            f"{type(self).__name__}: requires_grad changed after wrapping (frozen: "
            f"{sorted(names.get(i, '?') for i in was - is_)}, unfrozen: {sorted(names.get(i, '?') for i in is_ - was)})"
            "; the engine plans its all-reduces at construction, so wrap the module again after freezing or "
            "unfreezing (the new wrapper replaces this one), on every rank")

    def _begin_sync(self) -> None:
        """A synchronizing step's collectives before the module runs, in one order on every rank (a DDP engine's
        strategy broadcasts the buffers itself: every collective of its step then goes through it)."""
        if self.sync is None and self.buffers_to_sync:
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
        """A hooked gradient arrived: decided here, once, whether it is reduced; then handed to the strategy."""
        if self.step is not Step.ARMED:  # the usual case (ARMED) costs one comparison: this runs per gradient
            if not self._should_sync():
                return
            raise RuntimeError(  # REDUCED: _should_sync refused LOCAL/DETACHED and raised on IDLE
                "a gradient arrived after this backward was already synchronized: a nested backward ended first "
                f"({REENTRANT}), or backward ran twice on one forward (run one backward per forward)")
        if not self._callback_queued:
            self._queue_end_of_backward()
        if self.sync is not None:
            self.sync.on_grad(p, k)

    def _queue_end_of_backward(self) -> None:
        """Run `_end_of_backward` once autograd has run out of work in the current backward (queued once).

        Synchronizing when backward ends (as torch DDP does) means no later forward/backward, e.g. a no_sync() step
        after a forgotten finish, can ever accumulate into a gradient still being reduced. The callback holds the
        wrapper weakly, as the gradient hooks do: autograd may hold a callback after its backward, and a bound
        method there would keep a dropped wrapper, and its model, alive.
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
        with record_function(f"ddp.{self._label}.{where}") if profiler_on() else nullcontext():
            self._synchronize()
        self.step = Step.REDUCED
        # publish the step's count: a copy of the tally's totals (read, not called: nothing below is entered again)
        self._marks = (self._marks[1], (Counter(self._tally.calls), Counter(self._tally.bytes)))

    # ------------------------------------------------------------------ what the strategy (or FSDP) does
    def _prepare_sync(self) -> None:
        """A synchronizing forward, before the module runs."""
        if self.sync is not None:
            self.sync.prepare()
            self._follow_hooks()

    def _synchronize(self) -> None:
        """Make every trainable gradient the rank average (collectives through ddp_lib.comm, tally=self._tally)."""
        if self.sync is None:
            raise NotImplementedError(f"{type(self).__name__} has no sync strategy: give one, or override this")
        try:
            self.sync.finish()
        finally:
            self._follow_hooks()

    def _land_in_flight(self) -> None:
        """Finish collectives an interrupted backward left running (before a forward, and on detach)."""
        if self.sync is not None:
            self.sync.land()

    def _follow_hooks(self) -> None:
        """The strategy changed which gradients it hears about: hook those instead."""
        if self._hooked is not self.sync.hooked:
            _remove_all(self._hooks)
            self._hooks.clear()
            self.register_grad_hooks(self.sync.hooked)

    # ------------------------------------------------------------------ comm accounting
    @property
    def comm_calls_by_kind(self) -> dict[str, int]:
        """Collectives per kind of the last synchronized step (its no_sync steps and forward included: all counted
        since the synchronized step before it)."""
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

    # ------------------------------------------------------------------ hooks, join, detach
    def register_grad_hooks(self, params: list[nn.Parameter]) -> None:
        """After backward accumulates the gradient of `p = params[k]`, call `self._grad_arrived(p, k)`.

        The hooks hold the wrapper weakly (no parameter -> hook -> wrapper -> module cycle keeps a dropped wrapper
        alive), and are removed when the wrapper is detached or collected.
        """
        wrapper = weakref.ref(self)

        def hook_for(k: int):
            def hook(p: nn.Parameter) -> None:
                w = wrapper()
                if w is not None:
                    w._grad_arrived(p, k)
            return hook

        self._hooked = params
        self._hooks.extend(p.register_post_accumulate_grad_hook(hook_for(k)) for k, p in enumerate(params))

    @contextmanager
    def join(self, divide_by_initial_world_size: bool = False) -> Iterator[None]:
        """Train on uneven inputs: a rank whose loop inside ends early shadows the others' steps until all are done.

        How, and where it differs from torch's `Join`: `ddp_lib/ddp/join.py`.
        """
        if self.sync is None:
            raise TypeError(f"{type(self).__name__} has no join(): it is the DDP engines'")
        if self._join is not None:
            raise RuntimeError("join() is already active")
        previous_div = self.sync.divide_by
        self._join = self.sync.join_part(divide_by_initial_world_size)
        try:
            yield
            while True:
                active, self.sync.setup_due = self._join.agree(False, self.sync.wants_setup())
                if not active:
                    break
                self._shadow_step()  # some rank still trains: join its step's collectives
            self._join.take_last_joiners_model(self.module)
        finally:
            self._join, self.sync.divide_by = None, previous_div

    def _shadow_step(self) -> None:
        """One synchronizing step's collectives, as a training rank issues them, with zero gradients."""
        with self._tally.uncounted():  # a shadow step is not a step of this rank's: comm_calls keeps the last one
            self._begin_sync()
            for p in self.trainable:
                p.grad = None  # the strategies send zeros for a parameter without a gradient, in their usual order
            self._synchronize()
        for p in self.trainable:
            p.grad = None  # nothing of the shadow step stays behind

    def detach(self) -> None:
        """Give the module back (its hooks removed, in-flight work finished); the wrapper can no longer be used."""
        self._land_in_flight()
        _remove_all(self._hooks)
        self._hooks.clear()
        self.step = Step.DETACHED


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
