"""What every DDP engine shares: init broadcast, forward delegation, no_sync, the sync contract."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.distributed as dist
import torch.nn as nn

from ddp_lib.comm import broadcast_coalesced, broadcast_module_state, group_rank0
from ddp_lib.ddp.guards import EngineGuards
from ddp_lib.devices import require_process_group
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

    def forward(self, *args, **kwargs):
        """Run the wrapped module; remember whether the coming backward synchronizes."""
        self._before_forward()
        self._sync_this_backward = self._grad_sync
        if self._sync_this_backward:
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

    # engines override these two
    def _prepare_sync(self) -> None:
        """Called by a synchronizing forward, before the module runs."""

    def _synchronize(self) -> int:
        """Make every trainable grad the rank average; return the number of all-reduce calls."""
        raise NotImplementedError
