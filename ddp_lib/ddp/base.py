"""What every DDP engine shares: init broadcast, forward delegation, no_sync, the sync contract."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib.comm import broadcast_coalesced, broadcast_module_state, group_rank0
from ddp_lib.ddp.guards import EngineGuards
from ddp_lib.devices import comm_device, require_process_group
from ddp_lib.profiling import phase

__all__ = ["DDPBase"]


class DDPBase(EngineGuards, nn.Module):
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
    False each rank keeps its own after the init broadcast. Re-wrapping a module (a re-run cell)
    detaches the previous wrapper; that and the other guards live in `ddp_lib.ddp.guards`.
    """

    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = True):
        super().__init__()
        require_process_group()
        self._start_guards(module)  # detach a previous wrapper of this module, reset the state flags
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        broadcast_module_state(module, process_group)  # replicas start as rank 0's, whatever the seeds
        # module.parameters() yields a tied parameter once: it is reduced once
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        self.buffers_to_sync = list(module.buffers()) if broadcast_buffers else []
        self.comm_calls = 0
        self._grad_sync = True  # toggled by no_sync()
        self._sync_this_backward = True  # captured by forward()
        self._grad_div = self.world_size  # engines divide each gradient by this (join: the ranks with data)
        self._joining = False  # inside join(): every synchronizing forward first agrees on who still has data
        self._join_divide_by_initial = False
        self._join_steps = 0  # synchronizing steps this rank ran inside join()

    def forward(self, *args, **kwargs):
        """Run the wrapped module; remember whether the coming backward synchronizes."""
        self._before_forward()
        self._sync_this_backward = self._grad_sync
        if self._sync_this_backward:
            if self._joining:
                self._grad_div = self._join_divisor(self._join_flags(still_has_data=True))
                self._join_steps += 1
            if self.buffers_to_sync:
                broadcast_coalesced(self.buffers_to_sync, group_rank0(self.process_group), self.process_group)
            self._prepare_sync()
            self._arm()
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: forward/backward only accumulate `.grad` locally; the next synchronized step reduces the sum."""
        previous, self._grad_sync = self._grad_sync, False
        try:
            yield
        finally:
            self._grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Block until every rank holds the rank-averaged gradients (no-op after a no_sync forward).

        OverlapDDP and BucketedDDP already did so when backward ended; then this only confirms.
        """
        if not self._should_sync():
            return
        if not self._reduced:
            with phase(f"ddp.{type(self).__name__}.finish"):
                self.comm_calls = self._synchronize()
        self._armed = False

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
        dist.all_reduce(flag, group=self.process_group)
        return int(flag.item())

    def _shadow_step(self) -> None:
        """One synchronizing step's collectives, as a training rank issues them, with zero gradients."""
        if self.buffers_to_sync:
            broadcast_coalesced(self.buffers_to_sync, group_rank0(self.process_group), self.process_group)
        self._prepare_sync()
        for p in self.trainable:
            p.grad = None  # the engines send zeros for a parameter without a gradient, in their usual order
        self._synchronize()
        for p in self.trainable:
            p.grad = None  # nothing of the shadow step stays behind

    def _sync_final_model(self) -> None:
        """Every rank takes the parameters and buffers of the rank that ran the most steps (highest rank on ties)."""
        key = torch.tensor([self._join_steps * self.world_size + dist.get_rank(self.process_group)],
                           device=comm_device(self.process_group))
        dist.all_reduce(key, op=dist.ReduceOp.MAX, group=self.process_group)
        src = int(key.item()) % self.world_size
        if self.process_group not in (None, dist.group.WORLD):
            src = dist.get_global_rank(self.process_group, src)
        broadcast_coalesced([p.data for p in self.module.parameters()] + list(self.module.buffers()), src,
                            self.process_group)

    # engines override these two
    def _prepare_sync(self) -> None:
        """Called by a synchronizing forward, before the module runs."""

    def _synchronize(self) -> int:
        """Make every trainable grad the rank average; return the number of all-reduce calls."""
        raise NotImplementedError
