"""The hardening under DDPBase: re-wrap registry, weak hooks, end-of-backward callback, state flags, layout fixes.

Lesson 04 teaches `base.py` (broadcast, forward, no_sync, finish); this module is what makes those
few lines survive notebook habits (a re-run cell, a forgotten finish, an interrupted backward) and
odd models (a parameter frozen after wrapping, a non-contiguous gradient). It is shown in lesson
04's "Under the hood" appendix.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib.profiling import phase

# module -> weak reference to the wrapper that drives it; weak both ways, so it keeps nothing alive
_WRAPPER_OF: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()


class EngineGuards:
    """Mixin of DDPBase: the bookkeeping that keeps an engine correct across notebook habits."""

    module: nn.Module
    trainable: list[nn.Parameter]
    comm_calls: int
    _sync_this_backward: bool

    def _start_guards(self, module: nn.Module) -> None:
        """Detach the module's previous wrapper (a re-run cell), reset the flags, register this one."""
        previous = _WRAPPER_OF.get(module)
        if previous is not None and previous() is not None:
            previous().detach()
        self._armed = False  # a synchronizing forward ran through the wrapper and awaits its finish
        self._reduced = False  # the end-of-backward callback already synchronized (hook engines)
        self._callback_queued = False
        self._handles: list[dist.Work] = []  # async all-reduces in flight (OverlapDDP, BucketedDDP)
        self._hook_handles: list = []
        self._detached = False
        _WRAPPER_OF[module] = weakref.ref(self)

    def _before_forward(self) -> None:
        """Refuse a detached wrapper or a changed trainable set; finish all-reduces left in flight."""
        if self._detached:
            raise RuntimeError(f"this {type(self).__name__} was detached: a newer wrapper of the same module "
                               "replaced it (a re-run cell?); use the new wrapper")
        self._check_trainable_unchanged()
        if self._handles:  # left by an interrupted backward: never let autograd write into buffers in flight
            self._wait_for_handles()

    def _arm(self) -> None:
        """A synchronizing forward ran: its backward may reduce, and finish must follow."""
        self._armed, self._reduced, self._callback_queued = True, False, False

    def _check_trainable_unchanged(self) -> None:
        """Fail loudly, as torch DDP does, when requires_grad changed after wrapping.

        The engines plan their all-reduces (and buckets, and hooks) from the parameters that required
        gradients at construction. A parameter frozen later would still get a (zero) gradient, which
        AdamW's weight decay and momentum turn into updates; one unfrozen later would never be averaged
        and the replicas would drift apart. Both are silent, so the forward refuses: wrap again.
        """
        now = [p for p in self.module.parameters() if p.requires_grad]
        if len(now) == len(self.trainable) and all(a is b for a, b in zip(now, self.trainable)):
            return
        was, is_ = {id(p) for p in self.trainable}, {id(p) for p in now}
        names = {id(p): n for n, p in self.module.named_parameters()}
        frozen = [names.get(i, "?") for i in was - is_]
        unfrozen = [names.get(i, "?") for i in is_ - was]
        raise RuntimeError(
            f"{type(self).__name__}: requires_grad changed after wrapping (frozen: {sorted(frozen)}, "
            f"unfrozen: {sorted(unfrozen)}); the engine plans its all-reduces at construction, so wrap "
            "the module again after freezing or unfreezing (the new wrapper replaces this one), on every rank")

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

    def _synchronize(self) -> int:
        raise NotImplementedError

    def _wait_for_handles(self) -> int:
        """Wait for every async all-reduce launched in this backward; return how many there were."""
        with phase("ddp.wait"):
            for handle in self._handles:
                handle.wait()
        calls, self._handles = len(self._handles), []
        return calls

    def _grad_or_zeros(self, p: nn.Parameter) -> torch.Tensor:
        """The local gradient, installed as `.grad`: zeros when this rank produced none, made contiguous if not.

        gloo and NCCL reduce only contiguous tensors, and a parameter made from a transposed view gets
        a gradient with the same (transposed) strides. A contiguous `.grad` is as
        good to autograd (later backwards accumulate into it in place) and to the optimizer.
        """
        if p.grad is None:
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        elif not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        return p.grad


def _remove_all(handles: list) -> None:
    for h in handles:
        h.remove()
