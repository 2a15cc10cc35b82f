"""What every DDP engine shares: init broadcast, forward delegation, no_sync, the sync contract."""

from __future__ import annotations

import weakref
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


def group_rank0(group=None) -> int:
    """The global rank of `group`'s rank 0 (collectives name their source by global rank)."""
    return dist.get_global_rank(group, 0) if group not in (None, dist.group.WORLD) else 0


def broadcast_module_state(module: nn.Module, group=None) -> None:
    """Copy rank 0's parameters (trainable and frozen) and buffers to every rank."""
    broadcast_coalesced([p.data for p in module.parameters()] + list(module.buffers()), group_rank0(group), group)


# module -> weak reference to the wrapper that drives it; weak both ways, so it keeps nothing alive
_WRAPPER_OF: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


class DDPBase(nn.Module):
    """Base of NaiveDDP, FlatDDP, OverlapDDP and BucketedDDP.

    After `loss.backward()` and `finish_gradient_synchronization()`, every trainable parameter's
    `.grad` holds the gradient averaged over ranks. A parameter that got no gradient on a rank
    contributes zeros (it never hangs the step). One that got none on *any* rank ends with an
    exact zero gradient, not `None`: telling the two apart costs one more all-reduce per step
    (torch DDP's find_unused_parameters=True pays it); with zeros, plain SGD leaves it alone
    but weight decay and momentum still move it, so freeze a parameter that is never used.
    Whether a backward synchronizes is decided by the forward that built its graph, as in torch
    DDP: run forward *and* backward inside `no_sync()` to accumulate locally.

    `broadcast_buffers=True` (torch's default) copies rank 0's buffers (e.g. BatchNorm's running
    statistics) to every rank at each forward outside `no_sync()`, one broadcast per dtype
    (torch DDP also skips the forward that follows a no_sync or no_grad one); with False each
    rank keeps its own after the init broadcast.
    Wrapping a module again (re-running a notebook cell) detaches the previous wrapper: its
    hooks are removed and using it raises an error. Hooks hold the wrapper only weakly.
    """

    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = True):
        super().__init__()
        require_process_group()
        previous = _WRAPPER_OF.get(module)
        if previous is not None and previous() is not None:
            previous().detach()
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        broadcast_module_state(module, process_group)
        # module.parameters() yields a tied parameter once: it is reduced once
        self.trainable = [p for p in module.parameters() if p.requires_grad]
        self.buffers_to_sync = list(module.buffers()) if broadcast_buffers else []
        self.comm_calls = 0
        self._grad_sync = True  # toggled by no_sync()
        self._sync_this_backward = True  # captured by forward()
        self._armed = False  # a synchronizing forward ran through the wrapper and awaits its finish
        self._reduced = False  # the end-of-backward callback already synchronized (hook engines)
        self._callback_queued = False
        self._handles: list[dist.Work] = []  # async all-reduces in flight (OverlapDDP, BucketedDDP)
        self._hook_handles: list = []
        self._detached = False
        _WRAPPER_OF[module] = weakref.ref(self)

    def forward(self, *args, **kwargs):
        """Run the wrapped module; remember whether the coming backward synchronizes."""
        if self._detached:
            raise RuntimeError(f"this {type(self).__name__} was detached: a newer wrapper of the same module "
                               "replaced it (a re-run cell?); use the new wrapper")
        if self._handles:  # left by an interrupted backward: never let autograd write into buffers in flight
            self._wait_for_handles()
        self._sync_this_backward = self._grad_sync
        if self._sync_this_backward:
            if self.buffers_to_sync:
                broadcast_coalesced(self.buffers_to_sync, group_rank0(self.process_group), self.process_group)
            self._prepare_sync()
            self._armed, self._reduced, self._callback_queued = True, False, False
        return self.module(*args, **kwargs)

    def register_grad_hooks(self, params: list[nn.Parameter]) -> None:
        """Call `self._on_grad_ready(p, k)` after backward accumulates the gradient of `p = params[k]`.

        The hooks hold the wrapper weakly (no parameter -> hook -> wrapper -> module cycle keeps a
        dropped wrapper alive), and are removed when the wrapper is detached or collected.
        """
        wrapper = weakref.ref(self)

        def hook_for(k: int):
            def hook(p: nn.Parameter) -> None:
                ddp = wrapper()
                if ddp is not None:
                    ddp._on_grad_ready(p, k)
            return hook

        self._hook_handles = [p.register_post_accumulate_grad_hook(hook_for(k)) for k, p in enumerate(params)]
        weakref.finalize(self, _remove_all, self._hook_handles)

    def detach(self) -> None:
        """Remove this wrapper's hooks from the module; the wrapper can no longer be used."""
        self._wait_for_handles()
        _remove_all(self._hook_handles)
        self._detached = True

    def _on_grad_ready(self, p: nn.Parameter, k: int) -> None:
        """Hook engines override this; it runs once per parameter per backward (k: its index in the hooked list)."""

    def _should_sync(self) -> bool:
        """Whether gradients arriving now are to be reduced; a clear error if the forward bypassed us."""
        if not self._sync_this_backward:
            return False
        if not self._armed:
            raise RuntimeError(
                f"{type(self).__name__}: gradients to synchronize without a forward through the wrapper: "
                "call ddp(x), not ddp.module(x), and finish_gradient_synchronization() once per backward")
        return True

    def _in_backward_sync(self) -> bool:
        """For hooks: whether to reduce this gradient; on the first, schedule the end-of-backward sync.

        Waiting for every all-reduce when backward ends (as torch DDP does) means no later
        forward/backward, e.g. a no_sync() step after a forgotten finish, can ever accumulate
        into a gradient that is still being reduced.
        """
        if not self._should_sync():
            return False
        if self._reduced:
            raise RuntimeError(
                "a gradient arrived after this backward was already synchronized: a nested backward "
                "(reentrant checkpointing?) ended first, or backward ran twice on one forward; use "
                "torch.utils.checkpoint with use_reentrant=False and one backward per forward")
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        return True

    def _end_of_backward(self) -> None:
        with phase(f"ddp.{type(self).__name__}.end_of_backward"):
            self.comm_calls = self._synchronize()
        self._reduced = True

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


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
