"""Lesson 05: gradients gathered into ~25 MB buckets; each full bucket is all-reduced during backward."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib.ddp.base import DDPBase
from ddp_lib.profiling import phase


@dataclass
class Bucket:
    """Parameters whose gradients live side by side in one persistent flat buffer."""

    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor]  # views[i] is params[i]'s slot in buffer, shaped like the parameter
    pending: int = 0  # gradients still to arrive in this backward
    ready: list[bool] = field(default_factory=list)


def assign_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Group `params` (in the order backward produces them) into buckets of one dtype and device.

    As in torch DDP's bucket assignment there is one open bucket per (dtype, device), so
    interleaved bf16 weights and fp32 norms still fill big buckets, and a bucket is closed as
    soon as it reaches the cap (so it may overshoot it by up to one tensor, and no small
    leftover bucket is cut off mid-model). Buckets are ordered by when they close (the position
    of their last parameter): the order in which backward completes them, the same on every rank.
    """
    open_: dict[tuple, list[nn.Parameter]] = {}
    size: dict[tuple, int] = {}
    closed: list[list[nn.Parameter]] = []
    for p in params:
        kind = (p.dtype, p.device)
        open_.setdefault(kind, []).append(p)
        size[kind] = size.get(kind, 0) + p.numel() * p.element_size()
        if size[kind] >= cap_bytes:  # full: a parameter at least as large as the cap is a bucket of its own
            closed.append(open_.pop(kind))
            del size[kind]
    position = {p: i for i, p in enumerate(params)}
    return sorted(closed + list(open_.values()), key=lambda b: position[b[-1]])


class BucketedDDP(DDPBase):
    """Async all-reduce per bucket, buckets filled in reverse parameter order (the order of backward).

    Each bucket owns one flat buffer for its whole life; after a synchronizing step every
    gradient *is* a view into that buffer, so there is no flatten/unflatten allocation per step
    (with `zero_grad(set_to_none=False)` there is no copy either). Buckets are launched strictly
    in order, so every rank issues the same collectives in the same sequence. When backward
    ends, buckets never filled (unused parameters) are launched and all are waited for.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, process_group=None,
                 broadcast_buffers: bool = True):
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb!r}")
        super().__init__(module, process_group, broadcast_buffers)
        self.bucket_size_mb = bucket_size_mb
        groups = assign_buckets(list(reversed(self.trainable)), int(bucket_size_mb * 1024 * 1024))
        self.buckets = [self._new_bucket(params) for params in groups]
        self._slots = [(b, i) for b in self.buckets for i in range(len(b.params))]  # hook k -> its bucket slot
        self._next = 0  # the next bucket to launch
        self.register_grad_hooks([p for b in self.buckets for p in b.params])

    @staticmethod
    def _new_bucket(params: list[nn.Parameter]) -> Bucket:
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        views, offset = [], 0
        for p in params:
            views.append(buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return Bucket(params, buffer, views)

    def _prepare_sync(self) -> None:
        for b in self.buckets:
            b.pending, b.ready = len(b.params), [False] * len(b.params)
        self._next = 0

    def _on_grad_ready(self, p: nn.Parameter, k: int) -> None:
        if not self._in_backward_sync():
            return
        bucket, i = self._slots[k]
        if bucket.ready[i]:
            raise RuntimeError(
                "a parameter was marked ready twice in one backward: its gradient was produced by two "
                "separate backward passes (reentrant checkpointing?); use use_reentrant=False")
        self._to_averaging_view(p, bucket.views[i])
        bucket.ready[i] = True
        bucket.pending -= 1
        if bucket.pending == 0:  # only a completed bucket can let launches move on
            while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
                self._launch(self.buckets[self._next])

    def _to_averaging_view(self, p: nn.Parameter, view: torch.Tensor) -> None:
        """Make p.grad the bucket view, holding the local gradient divided by the world size.

        Dividing each gradient as it arrives, while it is still in cache, is cheaper than a pass
        over the whole bucket at launch (torch DDP does the same); the sum of the divided
        gradients is the average. A gradient autograd allocated elsewhere is divided into the view.
        """
        grad = p.grad
        if grad is view:  # the usual case after the first step: autograd accumulated into the view
            view.div_(self.world_size)
            return
        if grad is None:
            view.zero_()  # no gradient on this rank: contribute zeros
        else:
            torch.div(grad, self.world_size, out=view)  # safe when grad aliases view: elementwise
        p.grad = view

    def _launch(self, bucket: Bucket) -> None:
        if bucket.pending:
            for i, p in enumerate(bucket.params):
                if not bucket.ready[i]:  # never arrived (unused on this rank): its current .grad or zeros
                    self._to_averaging_view(p, bucket.views[i])
        with phase(f"ddp.allreduce.bucket{self._next}"):
            self._handles.append(dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True))
        self._next += 1

    def _synchronize(self) -> int:
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        return self._wait_for_handles()
