"""What every DDP engine shares: init broadcast, forward delegation, no_sync, the sync contract."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lib.mesh import require_process_group
from ddp_lib.profiling import phase


def group_by_kind(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split tensors into lists of one dtype and device each (a flat buffer holds only one kind)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def broadcast_coalesced(tensors: list[torch.Tensor], src: int, group=None) -> None:
    """Overwrite `tensors` on every rank with global rank `src`'s, one flat broadcast per dtype/device."""
    for same_kind in group_by_kind(tensors):
        flat = _flatten_dense_tensors(same_kind)
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:
            for t, new in zip(same_kind, _unflatten_dense_tensors(flat, same_kind)):
                t.copy_(new)


def broadcast_module_state(module: nn.Module, group=None) -> None:
    """Copy rank 0's parameters (trainable and frozen) and buffers to every rank."""
    src = dist.get_global_rank(group, 0) if group not in (None, dist.group.WORLD) else 0
    broadcast_coalesced([p.data for p in module.parameters()] + list(module.buffers()), src, group)


class DDPBase(nn.Module):
    """Base of NaiveDDP, FlatDDP, OverlapDDP and BucketedDDP.

    After `loss.backward()` and `finish_gradient_synchronization()`, every trainable parameter's
    `.grad` holds the gradient averaged over ranks. A parameter that got no gradient on a rank
    contributes zeros (it never hangs the step); one that got none on any rank ends with a zero
    gradient. Whether a backward synchronizes is decided by the forward that built its graph,
    as in torch DDP: run forward *and* backward inside `no_sync()` to accumulate locally.
    """

    def __init__(self, module: nn.Module, process_group=None):
        super().__init__()
        require_process_group()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        broadcast_module_state(module, process_group)
        # module.parameters() yields a tied parameter once: it is reduced once
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        self.comm_calls = 0
        self._grad_sync = True  # toggled by no_sync()
        self._sync_this_backward = True  # captured by forward()
        self._armed = False  # a synchronizing forward ran through the wrapper and awaits its finish
        self._handles: list[dist.Work] = []  # async all-reduces in flight (OverlapDDP, BucketedDDP)

    def forward(self, *args, **kwargs):
        """Run the wrapped module; remember whether the coming backward synchronizes."""
        self._sync_this_backward = self._grad_sync
        if self._sync_this_backward:
            if self._handles:
                raise RuntimeError("a synchronizing forward ran before finish_gradient_synchronization() "
                                   "of the previous backward: call it after every synchronizing backward")
            self._prepare_sync()
            self._armed = True
        return self.module(*args, **kwargs)

    def _should_sync(self) -> bool:
        """Whether gradients arriving now are to be reduced; a clear error if the forward bypassed us."""
        if not self._sync_this_backward:
            return False
        if not self._armed:
            raise RuntimeError(
                f"{type(self).__name__}: gradients to synchronize without a forward through the wrapper: "
                "call ddp(x), not ddp.module(x), and finish_gradient_synchronization() once per backward")
        return True

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: forward/backward only accumulate `.grad` locally; the next synchronized step reduces the sum."""
        previous, self._grad_sync = self._grad_sync, False
        try:
            yield
        finally:
            self._grad_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Block until every rank holds the rank-averaged gradients (no-op after a no_sync forward)."""
        if not self._should_sync():
            return
        with phase(f"ddp.{type(self).__name__}.finish"):
            self.comm_calls = self._synchronize()
        self._armed = False

    # engines override these two
    def _prepare_sync(self) -> None:
        """Called by a synchronizing forward, before the module runs."""

    def _synchronize(self) -> int:
        """Make every trainable grad the rank average; return the number of all-reduce calls."""
        raise NotImplementedError

    def _wait_for_handles(self) -> int:
        """Wait for every async all-reduce launched in this backward; return how many there were."""
        with phase("ddp.wait"):
            for handle in self._handles:
                handle.wait()
        calls, self._handles = len(self._handles), []
        return calls

    def _grad_or_zeros(self, p: nn.Parameter) -> torch.Tensor:
        """The local gradient, or zeros installed as `.grad` when this rank produced none."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad
