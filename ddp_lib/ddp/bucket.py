"""Lesson 05: a bucket (parameters whose gradients share one persistent flat buffer) and the bucket plan."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib.ddp.comm_hook import flat_views
from ddp_lib.ddp.strategy import TWICE

__all__ = ["Bucket", "assign_buckets", "FIRST_BUCKET_MB"]

FIRST_BUCKET_MB = dist._DEFAULT_FIRST_BUCKET_BYTES / 2**20  # torch DDP's first-bucket cap (1 MiB) when bucket_cap_mb is left unset


class Bucket:
    """Parameters whose gradients live side by side in one persistent flat buffer.

    Its views (one per parameter) are built once; after a synchronizing step every `.grad` is its view. One
    backward, per bucket: `mark_ready(i)` for each gradient as it arrives (True once the bucket is full), `fill(d)`
    once it and every bucket before it are full (the engine then sends `buffer`), `reset()` before the next
    synchronizing backward. It calls no collective: the engine's strategy sends it.
    """

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views = flat_views(self.buffer, params)  # views[i]: params[i]'s slot in buffer, shaped like it
        self.reset()

    def reset(self) -> None:
        """Ready for the next backward: no gradient arrived yet."""
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)  # gradients still to arrive in this backward

    @property
    def full(self) -> bool:
        return self.pending == 0

    def mark_ready(self, i: int) -> bool:
        """`params[i]`'s gradient arrived: into its slot (a view of the buffer); True once the bucket is full."""
        if self.ready[i]:
            raise RuntimeError(f"a parameter was {TWICE}")
        if self.params[i].grad is not self.views[i]:  # else autograd accumulated into the view (zero_grad(False))
            self._take_grad(i)
        self.ready[i] = True
        self.pending -= 1
        return self.pending == 0

    def fill(self, divide_by: int) -> torch.Tensor:
        """The buffer, ready to send: a gradient that never arrived (its parameter unused on this rank) goes in as
        its current `.grad`, or zeros; then the whole buffer is divided by `divide_by` (the world size).

        One division of the whole buffer, not one per gradient as it arrives: the same elements are divided once
        either way, and a torch call per gradient is what costs on the host here (small gradients, Python hooks).
        """
        if self.pending:  # sent before every gradient arrived: only when backward ends (unused parameters)
            for i, ready in enumerate(self.ready):
                if not ready:
                    self._take_grad(i)
        if divide_by != 1:
            self.buffer.div_(divide_by)  # the sum of the divided gradients is the average
        return self.buffer

    def holds_gradients(self) -> bool:
        """Whether some `.grad` is its view and the buffer holds a nonzero value (gradients to carry to a new plan)."""
        return any(p.grad is v for p, v in zip(self.params, self.views)) and bool(self.buffer.any())

    def adopt_grads(self) -> None:
        """A new plan: move gradients accumulated elsewhere (no_sync steps, an older bucket) into the views."""
        for p, view in zip(self.params, self.views):
            if p.grad is not None and p.grad is not view:
                view.copy_(p.grad)
                p.grad = view

    def bind_grads(self) -> int:
        """At a synchronizing forward: make every `.grad` its view (zeros where it was None, as after
        `zero_grad()`), so that backward accumulates each gradient into the buffer in place; return the buffer's
        version (each in-place accumulation into a view bumps it: views share the counter with their base)."""
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            if p.grad is not view:  # the usual case after the first step is a view already: no call
                self._take_grad(i)
        return self.buffer._version

    def _take_grad(self, i: int) -> None:
        """Make `params[i].grad` its view of the buffer, holding the local gradient (copied in if autograd put it
        elsewhere: the first step, a rebuild, a gradient set by hand)."""
        p, view = self.params[i], self.views[i]
        grad = p.grad
        if grad is view:  # the usual case after the first step: autograd accumulated into the view
            return
        if grad is None:
            view.zero_()  # no gradient on this rank: contribute zeros
        else:
            view.copy_(grad)
        p.grad = view


def assign_buckets(params: list[nn.Parameter], cap_bytes: int, first_cap_bytes: int | None = None
                   ) -> list[list[nn.Parameter]]:
    """Group `params` (in the order backward produces them) into buckets of one dtype and device.

    The first bucket of each (dtype, device) closes at `first_cap_bytes` (default: `cap_bytes`), the others at
    `cap_bytes`. Here `params` come in backward order, so the small bucket is the first launched: it holds the
    gradients ready first, and its benefit is that communication starts early, after 1 MiB of gradients rather
    than a full 25 MB bucket. torch DDP has the same cap (`dist._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB) only when
    `bucket_cap_mb` is left unset (`BucketCapacityConfig` in `torch/nn/parallel/distributed.py`), and its comment
    there is about its *initial* assignment, made in parameter definition order and then reversed for the Reducer:
    there the small bucket holds "parameters that are defined first, such that their gradients don't spill into a
    much larger bucket, adding unnecessary latency after gradient computation finishes", i.e. the bucket reduced
    last (and with `find_unused_parameters=False`, its default, that initial plan is one bucket anyway,
    `[sys.maxsize]`). torch hands the cap to its C++ Reducer as well, which rebuilds the buckets after the first
    iteration in the order gradients arrived, as `BucketedDDP` does.

    As in torch DDP's bucket assignment there is one open bucket per (dtype, device), so
    interleaved bf16 weights and fp32 norms still fill big buckets, and a bucket is closed as
    soon as it reaches the cap (so it may overshoot it by up to one tensor, and no small
    leftover bucket is cut off mid-model). Buckets are ordered by when they close (the position
    of their last parameter): the order in which backward completes them, the same on every rank.
    """
    open_: dict[tuple, list[nn.Parameter]] = {}
    size: dict[tuple, int] = {}
    closed: list[list[nn.Parameter]] = []
    started: set[tuple] = set()  # kinds whose first bucket is closed
    first = cap_bytes if first_cap_bytes is None else min(first_cap_bytes, cap_bytes)
    for p in params:
        kind = (p.dtype, p.device)
        open_.setdefault(kind, []).append(p)
        size[kind] = size.get(kind, 0) + p.numel() * p.element_size()
        if size[kind] >= (cap_bytes if kind in started else first):  # full (a tensor over the cap: alone)
            closed.append(open_.pop(kind))
            del size[kind]
            started.add(kind)
    position = {p: i for i, p in enumerate(params)}
    return sorted(closed + list(open_.values()), key=lambda b: position[b[-1]])
