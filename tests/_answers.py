"""The lessons' own answers that several test files plant mistakes into, and the planted mistakes that several
suites share (one copy)."""

from __future__ import annotations

from contextlib import contextmanager

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


class BucketsLaunchAtEnd(HandBuckets):  # right numbers, no overlap
    def _ready(self, p):
        self.pending[self.where[p]] -= 1

    def finish(self) -> int:
        for i in range(len(self.buckets)):
            self._launch(i)
        return super().finish()


class HandLaunchInFinish(HandOverlap):  # correct gradients, but nothing overlaps backward
    def __init__(self, model):
        self.params = list(model.parameters())

    def finish(self) -> int:
        for p in self.params:
            p.grad.div_(dist.get_world_size())
            dist.all_reduce(p.grad)
        return len(self.params)


def accum_sync_every_micro_batch(ddp, micro_batches, loss_fn):
    for x, y in micro_batches:
        (loss_fn(ddp(x), y) / len(micro_batches)).backward()
        ddp.sync_gradients()


def verify_local_verdict(model):  # the seed check's mistake: only the ranks that differ raise
    for p in model.parameters():
        p0 = p.detach().clone()
        dist.broadcast(p0, src=0)
        if not torch.equal(p0, p):
            raise ValueError("differs")


def accum_no_division(ddp, micro_batches, loss_fn):
    for i, (x, y) in enumerate(micro_batches):
        with (torch.enable_grad() if i == len(micro_batches) - 1 else ddp.no_sync()):
            loss_fn(ddp(x), y).backward()
    ddp.sync_gradients()


class LearnerDDP:
    """Lesson 04's engine as a learner writes it (one all-reduce per gradient in finish), with switchable mistakes."""

    broadcast, skip_none, divide_before, divide_after = True, False, True, False
    hooks_ignore_no_sync, refuse_locally = False, False

    def __init__(self, module):
        self.module, self._sync = module, True
        if self.refuse_locally:  # only the ranks that differ from rank 0 raise
            for p in module.parameters():
                p0 = p.detach().clone()
                dist.broadcast(p0, src=0)
                if not torch.equal(p0, p):
                    raise ValueError("replicas differ")
        if self.broadcast:
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=0)
        if self.hooks_ignore_no_sync:  # reduces each gradient as it arrives, no_sync or not
            for p in self._trainable():
                p.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(torch.zeros(1)))

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self):
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _trainable(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def finish_gradient_synchronization(self):
        if not self._sync:
            return
        for p in self._trainable():
            if p.grad is None:
                if self.skip_none:
                    continue
                p.grad = torch.zeros_like(p)
            if self.divide_before:
                p.grad /= dist.get_world_size()
            dist.all_reduce(p.grad)
            if self.divide_after:
                p.grad /= dist.get_world_size()
