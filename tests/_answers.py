"""The lessons' own answers that several test files plant mistakes into (one copy)."""

from __future__ import annotations

import torch.distributed as dist


class HandOverlap:  # lesson 05's solution: overlap by hand, one async all-reduce per gradient from its hook
    def __init__(self, model):
        self.handles = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p):
        p.grad.div_(dist.get_world_size())
        self.handles.append(dist.all_reduce(p.grad, async_op=True))

    def finish(self) -> int:
        for h in self.handles:
            h.wait()
        n, self.handles = len(self.handles), []
        return n
