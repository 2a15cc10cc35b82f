"""What every DDP engine shares: init broadcast, the parameters it averages, join(), the engines' helpers."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.comm import broadcast_coalesced, broadcast_module_state
from ddp_lib.devices import comm_device
from ddp_lib.wrapper import REENTRANT, DataParallelWrapper, Step, grad_or_zeros

__all__ = ["DDPBase"]

#: a hook engine's error when one parameter's gradient arrives twice in one backward
TWICE = f"marked ready twice in one backward: its gradient was produced by two separate backward passes ({REENTRANT})"


class DDPBase(DataParallelWrapper):
    """Base of NaiveDDP, FlatDDP, OverlapDDP and BucketedDDP.

    After `loss.backward()` and `finish_gradient_synchronization()`, every trainable parameter's
    `.grad` holds the gradient averaged over ranks. A parameter that got no gradient on a rank
    contributes zeros (it never hangs the step). One that got none on *any* rank ends with an
    exact zero gradient, not `None`: telling the two apart costs one more all-reduce per step
    (torch DDP's find_unused_parameters=True pays it); with zeros, plain SGD leaves it alone
    but weight decay and momentum still move it, so freeze a parameter that is never used, and
    wrap again after freezing (a forward raises if requires_grad changed since wrapping).
    Whether a backward synchronizes is decided by the forward that built its graph, as in torch
    DDP: run forward *and* backward inside `no_sync()` to accumulate locally.

    `broadcast_buffers=True` (torch's default) copies rank 0's buffers (e.g. BatchNorm's running
    statistics) to every rank at each forward outside `no_sync()`, one broadcast per dtype; with
    False each rank keeps its own after the init broadcast. `comm_calls` counts the all-reduces of the
    last synchronized step. The contract itself (forward, `no_sync`, finish, the end-of-backward
    callback, re-wrapping a module detaches its previous wrapper) lives in `ddp_lib.wrapper`, shared with FSDP;
    an engine supplies `_synchronize()` and, if it reduces during backward, `_on_grad_ready()`.
    """

    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = True):
        super().__init__(module, broadcast_buffers)
        self.process_group = self.sync_group = process_group
        self.world_size = dist.get_world_size(process_group)
        broadcast_module_state(module, process_group)  # replicas start as rank 0's, whatever the seeds
        # module.parameters() yields a tied parameter once: it is reduced once
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        self._frozen = [p for p in module.parameters() if not p.requires_grad]
        self._grad_div = self.world_size  # engines divide each gradient by this (join: the ranks with data)
        self._joining = False  # inside join(): every synchronizing forward first agrees on who still has data
        self._join_divide_by_initial = False
        self._join_steps = 0  # synchronizing steps this rank ran inside join()
        self._works: list = []  # a hook engine's reductions in flight (dist.Work, or a comm hook's HookWork)
        self._register()

    def _before_forward(self) -> None:
        super()._before_forward()
        self._check_trainable_unchanged()
        if self._joining and self._grad_sync:  # a synchronizing forward: first agree on who still has data
            self._grad_div = self._join_divisor(self._join_flags(still_has_data=True))
            self._join_steps += 1

    def _check_trainable_unchanged(self) -> None:
        """Fail loudly, as torch DDP does, when requires_grad changed after wrapping.

        The engines plan their all-reduces (and buckets, and hooks) from the parameters that required
        gradients at construction. A parameter frozen later would still get a (zero) gradient, which
        AdamW's weight decay and momentum turn into updates; one unfrozen later would never be averaged
        and the replicas would drift apart. Both are silent, so the forward refuses: wrap again. It reads the
        flag of each parameter the module had when wrapped (walking the module tree at every forward was most of
        the engine's forward overhead over the plain model on lesson 05's 32-block model: about 0.59 ms a step
        before, 0.13 ms after, measured on the loaded 2-core VM); a parameter added later is not seen.
        """
        if all(p.requires_grad for p in self.trainable) and not any(p.requires_grad for p in self._frozen):
            return
        now = [p for p in self.module.parameters() if p.requires_grad]
        was, is_ = {id(p) for p in self.trainable}, {id(p) for p in now}
        names = {id(p): n for n, p in self.module.named_parameters()}
        frozen = [names.get(i, "?") for i in was - is_]
        unfrozen = [names.get(i, "?") for i in is_ - was]
        raise RuntimeError(
            f"{type(self).__name__}: requires_grad changed after wrapping (frozen: {sorted(frozen)}, "
            f"unfrozen: {sorted(unfrozen)}); the engine plans its all-reduces at construction, so wrap "
            "the module again after freezing or unfreezing (the new wrapper replaces this one), on every rank")

    def _in_backward_sync(self) -> bool:
        """True inside a synchronizing backward. The wrapper's hook already decided before calling `_on_grad_ready`
        (`DataParallelWrapper._grad_arrived`); lesson 05's engines still ask, and get the same answer."""
        return self.step is Step.ARMED

    _grad_or_zeros = staticmethod(grad_or_zeros)  # the engines' name for it (lessons 04-05 call it so)

    def _all_reduce(self, tensor: torch.Tensor, async_op: bool = False, label: str = "ddp.allreduce"):
        """All-reduce `tensor` (summed) over the engine's group, counted in `comm_calls`."""
        return comm.all_reduce(tensor, self.process_group, async_op=async_op, tally=self._tally, label=label)

    def _land_in_flight(self) -> None:
        """Wait for the reductions a hook engine launched (an interrupted backward's, before a forward or detach)."""
        comm.wait_all(self._works)

    @contextmanager
    def join(self, divide_by_initial_world_size: bool = False) -> Iterator[None]:
        """Train on uneven inputs: a rank whose loop inside ends early shadows the others' steps until all are done.

        Inside, every synchronizing forward first all-reduces a "still has data" flag (one extra small
        all-reduce per step, as with torch's `Join`). On leaving the block, this rank is out of data: it keeps
        joining each step's collectives (buffer broadcast, then the engine's own all-reduces, in the same order)
        with zero gradients until the flag sums to zero. Then every rank takes the parameters and buffers of a
        rank that ran the most steps (torch's "last joiner"), since a joined rank skipped those optimizer steps.

        The gradient is divided by the number of ranks that still have data, so each step equals
        single-process training on the union of those ranks' batches (equal batch sizes);
        `divide_by_initial_world_size=True` divides by the world size instead (torch's default), which
        scales down the steps with fewer ranks. Optimizer state (e.g. momentum) on a joined rank is not
        synchronized, as with torch's `Join`. Where torch differs: with `broadcast_buffers` the buffers still
        come from rank 0 at every step, even once rank 0 is out of data (torch's join broadcasts them from a rank
        that still trains).
        """
        if self._joining:
            raise RuntimeError("join() is already active")
        previous_div = self._grad_div
        self._joining, self._join_divide_by_initial, self._join_steps = True, divide_by_initial_world_size, 0
        try:
            yield
            while self._join_flags(still_has_data=False):  # some rank still trains: shadow its step
                self._shadow_step()
            self._sync_final_model()
        finally:
            self._joining, self._grad_div = False, previous_div

    def _join_divisor(self, active: int) -> int:
        return self.world_size if self._join_divide_by_initial else active

    def _join_flags(self, still_has_data: bool) -> int:
        """All-reduce this rank's "still has data" flag; return how many ranks still have data."""
        flag = torch.tensor([int(still_has_data)], device=comm_device(self.process_group))
        comm.all_reduce(flag, self.process_group)
        return int(flag.item())

    def _shadow_step(self) -> None:
        """One synchronizing step's collectives, as a training rank issues them, with zero gradients."""
        with self._uncounted():  # a shadow step is not a step of this rank's: comm_calls keeps the last real one
            self._begin_sync()
            for p in self.trainable:
                p.grad = None  # the engines send zeros for a parameter without a gradient, in their usual order
            self._synchronize()
        for p in self.trainable:
            p.grad = None  # nothing of the shadow step stays behind

    def _sync_final_model(self) -> None:
        """Every rank takes the parameters and buffers of the rank that ran the most steps (highest rank on ties)."""
        key = torch.tensor([self._join_steps * self.world_size + dist.get_rank(self.process_group)],
                           device=comm_device(self.process_group))
        comm.all_reduce(key, self.process_group, op=dist.ReduceOp.MAX)
        src = comm.group_ranks(self.process_group)[int(key.item()) % self.world_size]
        broadcast_coalesced([p.data for p in self.module.parameters()] + list(self.module.buffers()), src,
                            self.process_group)
