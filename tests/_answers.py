"""The lessons' own answers that several test files plant mistakes into (one copy)."""

from __future__ import annotations

import torch
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


def plan_buckets(params, cap_bytes, first_cap_bytes):  # lesson 05's solution: the bucket plan
    buckets, size = [[]], 0
    for p in reversed(params):
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
        if size >= (first_cap_bytes if len(buckets) == 1 else cap_bytes):
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


class HandBuckets:  # lesson 05's solution: buckets by hand, one async all-reduce per full bucket
    def __init__(self, model, cap_mb=2.0):
        params = list(model.parameters())
        self.buckets = plan_buckets(params, int(cap_mb * 2**20), int(min(1.0, cap_mb) * 2**20))
        self.where = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.handles, self.flat = [], []
        self.reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def reset(self):
        self.pending, self.next = [len(b) for b in self.buckets], 0

    def _launch(self, i):
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]]).div_(dist.get_world_size())
        self.flat.append((i, flat))
        self.handles.append(dist.all_reduce(flat, async_op=True))

    def _ready(self, p):
        self.pending[self.where[p]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def _copy_back(self):
        for i, flat in self.flat:
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()

    def finish(self) -> int:
        for h in self.handles:
            h.wait()
        self._copy_back()
        n, self.handles, self.flat = len(self.handles), [], []
        self.reset()
        return n
