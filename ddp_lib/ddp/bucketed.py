"""Lesson 05: gradients gathered into ~25 MB buckets; each full bucket is all-reduced during backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.contract import REENTRANT, DataParallelWrapper
from ddp_lib.ddp.bucket import FIRST_BUCKET_MB, Bucket, assign_buckets
from ddp_lib.ddp.comm_hook import HookBucket, HookWork
from ddp_lib.ddp.per_bucket import PerBucketHooks
from ddp_lib.ddp.strategy import SyncStrategy


class BucketedSync(SyncStrategy):
    """Async all-reduce per bucket, buckets filled in the order backward produces gradients.

    Each bucket owns one flat buffer; after a synchronizing step every gradient *is* a view into it, so there is no
    flatten/unflatten allocation per step (with `zero_grad(set_to_none=False)` no copy either). Buckets are launched
    strictly in order, so every rank issues the same collectives in the same sequence; when backward ends, buckets
    never filled (unused parameters) are launched and all are waited for. The plan: a first bucket of
    `first_bucket_mb` (1 MiB) then `bucket_size_mb`, in reverse parameter order, then, at the second synchronizing
    forward, rebuilt once in the order the gradients really arrived during the first one (rank 0's order, broadcast,
    as torch's reducer `_rebuild_buckets` does); the old buffers are freed before the new ones are allocated.
    Once rebuilt, one hook per bucket (`ddp_lib/ddp/per_bucket.py`) when every parameter got a gradient here in the
    first synchronized backward and no comm hook is registered.
    """

    def __init__(self, module: nn.Module, trainable: list[nn.Parameter], group, tally: comm.Tally,
                 buffers: list[torch.Tensor], *, bucket_size_mb: float, first_bucket_mb: float, hook_per_bucket: bool):
        super().__init__(module, trainable, group, tally, buffers)
        self.bucket_size_mb, self.first_bucket_mb = bucket_size_mb, first_bucket_mb
        self.hook_per_bucket = hook_per_bucket  # False: one hook per gradient at every step
        self.hooked = self.each = list(reversed(trainable))  # hook k belongs to self.each[k]
        self.comm_hook = None  # (state, hook) once registered
        self.set_buckets(self.plan(self.each))
        self.arrivals: list[int] = []  # hook indices in arrival order, recorded during the first synced backward
        self.rebuilt = False  # True once the arrival-order plan was applied (or found identical)
        self.next = 0  # the next bucket to launch
        self.works: list = []  # reductions in flight (dist.Work, or a comm hook's HookWork)
        self.per_bucket = PerBucketHooks()

    def plan(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        return assign_buckets(params, int(self.bucket_size_mb * 2**20), int(self.first_bucket_mb * 2**20))

    def set_buckets(self, groups: list[list[nn.Parameter]]) -> None:
        self.buckets = [Bucket(params) for params in groups]
        index = {id(p): k for k, p in enumerate(self.each)}
        self.slots = {index[id(p)]: (b, i) for b in self.buckets for i, p in enumerate(b.params)}

    def set_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with `hook(state, bucket)`; hooked per gradient from now on (it writes the buffer
        whenever its future completes, which the version count cannot see)."""
        self.comm_hook = (state, hook)
        self.hooked, self.per_bucket.on = self.each, False

    def wants_setup(self) -> bool:
        return not self.rebuilt and bool(self.arrivals)

    # ------------------------------------------------------------------ the plan, rebuilt once
    def rebuild(self) -> None:
        """Re-plan the buckets in rank 0's arrival order (never-arrived parameters last); keep them if unchanged."""
        seen = set(self.arrivals)
        order = self.arrivals + [k for k in range(len(self.each)) if k not in seen]
        groups = self.plan([self.each[k] for k in self.rank0s(order)])
        self.rebuilt = True
        if [[id(p) for p in g] for g in groups] == [[id(p) for p in b.params] for b in self.buckets]:
            return  # same plan: keep the buffers (and the gradients living in them)
        # free the old buffers before allocating the new ones (weights and two sets of gradient buffers would not
        # fit a large model): a buffer holding gradients (no_sync steps) stays alive through its views only until
        # they are copied; the views of an all-zero buffer are dropped and come back as views of the new ones
        zeros = {id(p) for b in self.buckets if not b.holds_gradients()
                 for p, v in zip(b.params, b.views) if p.grad is v}
        for p in self.each:
            if id(p) in zeros:
                p.grad = None
        self.buckets, self.slots = [], {}
        self.set_buckets(groups)
        for b in self.buckets:
            b.adopt_grads()  # carried gradients (and any a user set by hand) move into the new views
            for p, v in zip(b.params, b.views):
                if id(p) in zeros:
                    p.grad = v  # zeros, as before the rebuild

    # ------------------------------------------------------------------ the verbs
    def prepare(self) -> None:
        super().prepare()
        if not self.rebuilt and (self.arrivals or self.setup_due):  # rank 0's order: every rank joins in
            self.rebuild()
            # the plan is final: one hook per bucket, if every parameter's gradient arrived here in the first
            # synchronized backward (a bucket holding one that did not would not count full in a step where it
            # again gets none, and if that one carried the hook it would not fire)
            if self.hook_per_bucket and self.comm_hook is None and len(self.arrivals) == len(self.each):
                self.hooked = self.per_bucket.last_arrived(self.buckets, self.arrivals, self.slots)
                self.per_bucket.on = True
        self.setup_due = False
        for b in self.buckets:
            b.reset()
        if self.per_bucket.on:
            self.per_bucket.begin([b.bind_grads() for b in self.buckets])
        self.next = 0

    def on_grad(self, p: nn.Parameter, k: int) -> None:
        """A gradient arrived: into its bucket; launch, in order, every bucket from the next one on that is full."""
        if self.per_bucket.on:  # k: the bucket whose last gradient this is
            if not self.per_bucket.full(k, self.buckets[k]):
                return
        else:
            bucket, i = self.slots[k]
            full = bucket.mark_ready(i)
            if not self.rebuilt:
                self.arrivals.append(k)
            if not full:  # only a completed bucket can let launches move on
                return
        while self.next < len(self.buckets) and self.buckets[self.next].full:
            self.launch(self.buckets[self.next])

    def launch(self, bucket: Bucket) -> "dist.Work | HookWork":
        """Send `bucket` (the next in order): its async all-reduce, or the comm hook on it; return its work, which
        is waited for when backward ends. Under a comm hook the buffer holds the summed local gradients: the hook
        divides by the world size itself, as torch's hooks do."""
        j, label = self.next, f"ddp.allreduce.bucket{self.next}"
        buffer = bucket.fill(1 if self.comm_hook is not None else self.divide_by)
        if self.comm_hook is None:
            work = self.all_reduce(buffer, async_op=True, label=label)
        else:  # a comm hook sends what it likes: counted as this bucket; its result is copied back on wait
            self.tally.add("all_reduce", buffer)
            state, hook = self.comm_hook
            with comm.traced(label):
                work = HookWork(hook(state, HookBucket(bucket, j, len(self.buckets))), into=buffer)
        self.works.append(work)
        if self.per_bucket.on:
            self.per_bucket.note_sent(j, bucket)
        self.next += 1
        return work

    def finish(self) -> None:
        """Backward ended: launch, in order, the buckets not yet launched, then wait for all. Hooked per bucket, a
        bucket that changed after it was sent may have missed a gradient: an error, raised once every reduction
        landed; after it, or a failed count, every gradient is hooked from the next step on."""
        while self.next < len(self.buckets):
            self.launch(self.buckets[self.next])
        late = self.per_bucket.late(self.buckets) if self.per_bucket.on else []
        self.wait_all(self.works)
        if self.per_bucket.on and (late or self.per_bucket.unproven):
            self.hooked, self.per_bucket.on = self.each, False
        if late:
            names = {id(p): n for n, p in self.module.named_parameters()}
            held = [names.get(id(p), "?") for p in self.buckets[late[0]].params]
            raise RuntimeError(
                f"BucketedDDP: bucket {late[0]} (of {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}) changed "
                "after the bucket was sent, or one of its .grads is no longer its view, so its average may miss a "
                f"gradient: a parameter's gradient arrived twice ({REENTRANT}), or a .grad was written or replaced "
                "during backward; from the next step the engine hooks every gradient again")

    def land(self) -> None:
        if self.works:  # an interrupted backward left some
            self.wait_all(self.works)


class BucketedDDP(DataParallelWrapper):
    """The front (`ddp_lib/contract.py`) driving `BucketedSync`; `register_comm_hook` as torch DDP's.

    Where torch DDP differs: with its default `find_unused_parameters=False` its FIRST iteration uses one bucket
    for all parameters (`[sys.maxsize]` in `distributed.py`), so real buckets exist only after the rebuild; and its
    1 MiB first-bucket cap applies only when `bucket_cap_mb` is left unset. docs/benchmarks.md races both ways of
    hooking against torch DDP's C++ reducer.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, process_group=None,
                 broadcast_buffers: bool = True, first_bucket_mb: float = FIRST_BUCKET_MB,
                 hook_per_bucket: bool = True):
        if not bucket_size_mb > 0 or not first_bucket_mb > 0:
            raise ValueError(f"bucket_size_mb and first_bucket_mb must be > 0, got {bucket_size_mb!r}, "
                             f"{first_bucket_mb!r}")
        super().__init__(module, broadcast_buffers, process_group=process_group, strategy=lambda *a: BucketedSync(
            *a, bucket_size_mb=bucket_size_mb, first_bucket_mb=first_bucket_mb, hook_per_bucket=hook_per_bucket))

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in launch order."""
        return self.sync.buckets

    @property
    def rebuilt(self) -> bool:
        """Whether the plan was rebuilt in the order gradients arrived (at the second synchronizing forward)."""
        return self.sync.rebuilt

    def register_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> torch.futures.Future[Tensor]`, torch's hook contract.

        `bucket` is a `HookBucket` (`ddp_lib/ddp/comm_hook.py`), offering what torch's `GradBucket` offers that
        torch's hooks use, so torch's `fp16_compress_hook` and `powerSGD_hook` run unchanged. As in torch DDP, under a
        hook the buffer holds the local gradients *summed, not averaged*: the hook divides by the world size itself.
        Register once (torch DDP enforces that too), before the first step.
        """
        if self.sync.comm_hook is not None:
            raise RuntimeError("register_comm_hook may only be called once")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        self.sync.set_comm_hook(state, hook)
        self._follow_hooks()
