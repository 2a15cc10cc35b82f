"""Lesson 05: gradients gathered into ~25 MB buckets; each full bucket is all-reduced during backward."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.comm import Tally, group_rank0
from ddp_lib.ddp.base import TWICE, DDPBase
from ddp_lib.ddp.comm_hook import HookBucket, HookWork, flat_views
from ddp_lib.devices import comm_device
from ddp_lib.wrapper import REENTRANT

FIRST_BUCKET_MB = dist._DEFAULT_FIRST_BUCKET_BYTES / 2**20  # torch DDP's first-bucket cap (1 MiB) when bucket_cap_mb is left unset


class Bucket:
    """Parameters whose gradients live side by side in one persistent flat buffer, and that buffer's reduction.

    Built with its group and the comm hook (if any); its views (one per parameter) are built once and are what the
    hook's `HookBucket.gradients()` returns. One backward, per bucket: `mark_ready(i)` for each gradient as it
    arrives (True once the bucket is full), `launch(...)` once it and every bucket before it are full (the engine
    waits for the work it returns when backward ends), `reset()` before the next synchronizing backward.

    Once the plan is final the engine may hook only the gradient that arrives last (`bind_grads`, `proven_full`,
    `sent_whole`): every in-place accumulation into a view bumps the buffer's version counter, which views share
    with it.
    """

    def __init__(self, params: list[nn.Parameter], group=None, comm_hook: tuple | None = None):
        self.params, self.group, self.comm_hook = params, group, comm_hook
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views = flat_views(self.buffer, params)  # views[i]: params[i]'s slot in buffer, shaped like it
        self.reset()

    def divisor(self, world_div: int) -> int:
        """What the buffer is divided by at launch: `world_div`, or 1 under a comm hook (it divides itself)."""
        return 1 if self.comm_hook is not None else world_div

    def reset(self) -> None:
        """Ready for the next backward: no gradient arrived yet, nothing in flight."""
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

    def launch(self, divide_by: int, index: int = 0, n_buckets: int = 1,
               tally: Tally | None = None) -> "dist.Work | HookWork":
        """Divide the buffer by `divide_by` (the world size), then start its async all-reduce (or the comm hook on
        it); return its work.

        A gradient that never arrived (its parameter unused on this rank) goes in as its current `.grad`, or zeros.
        One division of the whole buffer, not one per gradient as it arrives: the same elements are divided once
        either way, and a torch call per gradient is what costs on the host here (small gradients, Python hooks).
        """
        if self.pending:  # launched before every gradient arrived: only when backward ends (unused parameters)
            for i, ready in enumerate(self.ready):
                if not ready:
                    self._take_grad(i)
        if divide_by != 1:
            self.buffer.div_(divide_by)  # the sum of the divided gradients is the average
        label = f"ddp.allreduce.bucket{index}"
        if self.comm_hook is None:
            return comm.all_reduce(self.buffer, self.group, async_op=True, tally=tally, label=label)
        # a comm hook sends what it likes (torch's own hooks call torch.distributed): counted as this bucket; its
        # result is copied into the buffer, which every `.grad` views, when the work is waited for (HookWork)
        if tally is not None:
            tally.add("all_reduce", self.buffer)
        state, hook = self.comm_hook
        with comm.traced(label):
            return HookWork(hook(state, HookBucket(self, index, n_buckets)), into=self.buffer)

    def adopt_grads(self) -> None:
        """A new plan: move gradients accumulated elsewhere (no_sync steps, an older bucket) into the views."""
        for p, view in zip(self.params, self.views):
            if p.grad is not None and p.grad is not view:
                view.copy_(p.grad)
                p.grad = view

    def bind_grads(self) -> int:
        """At a synchronizing forward: make every `.grad` its view (zeros where it was None, as after
        `zero_grad()`), so that backward accumulates each gradient into the buffer in place; return the buffer's
        version."""
        for i, (p, view) in enumerate(zip(self.params, self.views)):
            if p.grad is not view:  # the usual case after the first step is a view already: no call
                self._take_grad(i)
        return self.buffer._version

    def sent_whole(self, sent_version: int) -> bool:
        """After backward, of a bucket sent at `sent_version`: no in-place write bumped the buffer's version since
        (a write through `.data` would escape), and every `.grad` is still its view, so every gradient of this
        backward went into the buffer before it was sent."""
        return self.buffer._version == sent_version and all(p.grad is v for p, v in zip(self.params, self.views))

    def proven_full(self, bound_version: int) -> bool:
        """Whether the buffer's version moved by exactly `len(params)` since `bind_grads` returned `bound_version`,
        what one in-place accumulation per parameter gives; if so, the bucket counts as full. A count, not a proof:
        a gradient accumulated twice can stand in for one still to come, and `sent_whole` catches that when
        backward ends."""
        if self.buffer._version - bound_version != len(self.params):
            return False
        self.pending = 0
        return True

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


class BucketedDDP(DDPBase):
    """Async all-reduce per bucket, buckets filled in the order backward produces gradients.

    Each bucket owns one flat buffer; after a synchronizing step every gradient *is* a view into
    it, so there is no flatten/unflatten allocation per step (with `zero_grad(set_to_none=False)`
    no copy either). Buckets are launched strictly in order, so every rank issues the same
    collectives in the same sequence; when backward ends, buckets never filled (unused
    parameters) are launched and all are waited for. The plan: a first bucket of `first_bucket_mb`
    (1 MiB) then `bucket_size_mb`, in reverse parameter order, then, at the second synchronizing
    forward, rebuilt once in the order the gradients really arrived during the first one (rank 0's
    order, broadcast, as torch's reducer `_rebuild_buckets` does). Where torch DDP differs: with its
    default `find_unused_parameters=False` its FIRST iteration uses one bucket for all parameters
    (`[sys.maxsize]` in `distributed.py`), so real buckets exist only after the rebuild; and its 1 MiB
    first-bucket cap applies only when `bucket_cap_mb` is left unset.

    Once the plan is rebuilt, one hook per bucket instead of one per gradient (`hook_per_bucket=True`): on the
    parameter whose gradient arrived last in that bucket on this rank, provided every parameter got a gradient here
    in the first synchronized backward (else, and under a comm hook, which writes the buffer whenever its future
    completes, one hook per gradient stays, or returns for a comm hook registered after the rebuild). At each
    synchronizing forward every `.grad` is made its view, so each accumulation bumps the buffer's version counter;
    the hook counts the bucket full when the counter moved by its number of parameters (`Bucket.proven_full`), and
    full buckets are launched in order. A count that does not add up (gradients in another order, a `.grad`
    replaced between forward and backward) leaves that bucket and every later one to backward's end, and from the
    next step the engine hooks every gradient, for good. The count only decides when to send: when backward ends, a
    bucket that changed after it was sent, or one of whose `.grad`s is no longer its view (`Bucket.sent_whole`), may
    have missed a gradient, and that is a clear error. docs/benchmarks.md races both ways of hooking against torch
    DDP's C++ reducer.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, process_group=None,
                 broadcast_buffers: bool = True, first_bucket_mb: float = FIRST_BUCKET_MB,
                 hook_per_bucket: bool = True):
        if not bucket_size_mb > 0 or not first_bucket_mb > 0:
            raise ValueError(f"bucket_size_mb and first_bucket_mb must be > 0, got {bucket_size_mb!r}, "
                             f"{first_bucket_mb!r}")
        super().__init__(module, process_group, broadcast_buffers)
        self.bucket_size_mb, self.first_bucket_mb = bucket_size_mb, first_bucket_mb
        self.hook_per_bucket = hook_per_bucket  # False: one hook per gradient at every step, as before the rebuild
        self._hooked = list(reversed(self.trainable))  # hook k belongs to self._hooked[k]
        self._comm_hook = None  # (state, hook) once register_comm_hook was called
        self._set_buckets(self._plan(self._hooked))
        self._arrivals: list[int] = []  # hook indices in arrival order, recorded during the first synced backward
        self.rebuilt = False  # True once the arrival-order plan was applied (or found identical)
        self._next = 0  # the next bucket to launch
        self._rebuild_due = False  # in join(): some rank will rebuild its buckets at this step, so every rank must
        self._per_bucket = False  # hooked once per bucket (its last gradient) rather than once per gradient
        self._bound: list[int] = []  # per bucket: its buffer's version once the step's gradients were bound to it
        self._sent: dict[int, int] = {}  # bucket index -> its buffer's version right after it was launched
        self._unproven = False  # a bucket's count did not add up in this backward
        self.register_grad_hooks(self._hooked)

    def register_comm_hook(self, state, hook) -> None:
        """Reduce each bucket with `hook(state, bucket) -> torch.futures.Future[Tensor]`, torch's hook contract.

        `bucket` is a `HookBucket` (`ddp_lib/ddp/comm_hook.py`), offering what torch's `GradBucket` offers
        that torch's hooks use (`buffer()`, `index()`, `is_last()`, `parameters()`, `gradients()`,
        `set_buffer()`), so torch's `fp16_compress_hook` and `powerSGD_hook` run unchanged. As in torch DDP, under a hook the buffer
        holds the local gradients *summed, not averaged*: the hook divides by the world size itself. The
        future's tensor is copied into the bucket when backward's end waits for it. Register once (torch DDP
        enforces that too), before the first step (torch's docstring asks for it before backward).
        """
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook may only be called once")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {hook!r}")
        self._comm_hook = (state, hook)
        if self._per_bucket:
            self._hook_each(self._hooked)
        for b in self.buckets:
            b.comm_hook = self._comm_hook  # from now on each bucket divides by 1 (`Bucket.divisor`)

    def _join_flags(self, still_has_data: bool) -> int:
        """All-reduce (has data, will rebuild buckets); return how many ranks still have data (`DDPBase.join`)."""
        will_rebuild = not self.rebuilt and bool(self._arrivals)
        flags = torch.tensor([int(still_has_data), int(will_rebuild)], device=comm_device(self.process_group))
        comm.all_reduce(flags, self.process_group)
        self._rebuild_due = flags[1].item() > 0
        return int(flags[0].item())

    def _plan(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        return assign_buckets(params, int(self.bucket_size_mb * 2**20), int(self.first_bucket_mb * 2**20))

    def _set_buckets(self, groups: list[list[nn.Parameter]]) -> None:
        self.buckets = [Bucket(params, self.process_group, self._comm_hook) for params in groups]
        index = {id(p): k for k, p in enumerate(self._hooked)}
        self._slots = {index[id(p)]: (b, i) for b in self.buckets for i, p in enumerate(b.params)}

    def _rebuild_buckets(self) -> None:
        """Re-plan the buckets in rank 0's arrival order (never-arrived parameters last); keep them if unchanged."""
        seen = set(self._arrivals)
        order = self._arrivals + [k for k in range(len(self._hooked)) if k not in seen]
        rank0_arrival_order = torch.tensor(order, dtype=torch.long, device=comm_device(self.process_group))
        comm.broadcast(rank0_arrival_order, group_rank0(self.process_group), self.process_group)
        groups = self._plan([self._hooked[k] for k in rank0_arrival_order.tolist()])
        self.rebuilt = True
        if [[id(p) for p in g] for g in groups] == [[id(p) for p in b.params] for b in self.buckets]:
            return  # same plan: keep the buffers (and the gradients living in them)
        self._set_buckets(groups)
        for b in self.buckets:
            b.adopt_grads()  # gradients accumulated in no_sync steps move into the new views

    def _prepare_sync(self) -> None:
        if not self.rebuilt and (self._arrivals or self._rebuild_due):  # rank 0's order: every rank joins in
            self._rebuild_buckets()
            self._hook_buckets()
        self._rebuild_due = False
        for b in self.buckets:
            b.reset()
        self._sent.clear()
        self._unproven = False
        if self._per_bucket:
            self._bound = [b.bind_grads() for b in self.buckets]
        self._next = 0

    def _hook_buckets(self) -> None:
        """The plan is final: hook each bucket once, on the gradient that arrived last in it on this rank (rank 0's
        order may differ). Only if every parameter's gradient arrived here in the first synchronized backward: a
        bucket holding one that did not would not count full in a step where it again gets none, and if that one
        carried the hook it would not fire. Not under a comm hook, nor when asked for one hook per gradient."""
        if not self.hook_per_bucket or self._comm_hook is not None or len(self._arrivals) < len(self._hooked):
            return  # (a gradient arriving twice raised in mark_ready: the arrivals hold each parameter once)
        last = {}  # bucket -> its parameter whose gradient arrived last on this rank
        for k in self._arrivals:
            bucket, i = self._slots[k]
            last[bucket] = bucket.params[i]
        self._hook_each([last[b] for b in self.buckets])

    def _hook_each(self, params: list[nn.Parameter]) -> None:
        """Replace the gradient hooks: one per parameter (`self._hooked`) or one per bucket (its last gradient)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.register_grad_hooks(params)
        self._per_bucket = params is not self._hooked

    def _on_grad_ready(self, p: nn.Parameter, k: int) -> None:
        """A gradient arrived: into its bucket; launch, in order, every bucket from the next one on that is full."""
        if self._per_bucket:  # k: the bucket whose last gradient this is
            if not self.buckets[k].proven_full(self._bound[k]):
                self._unproven = True  # this bucket waits for backward's end; the next step is hooked per gradient
                return
        else:
            bucket, i = self._slots[k]
            full = bucket.mark_ready(i)
            if not self.rebuilt:
                self._arrivals.append(k)
            if not full:  # only a completed bucket can let launches move on
                return
        while self._next < len(self.buckets) and self.buckets[self._next].full:
            self._launch(self.buckets[self._next])

    def _launch(self, bucket: Bucket) -> "dist.Work | HookWork":
        """Launch `bucket` (the next in order); return its work, which is waited for when backward ends."""
        work = bucket.launch(bucket.divisor(self._grad_div), self._next, len(self.buckets), tally=self._tally)
        self._works.append(work)
        if self._per_bucket:
            self._sent[self._next] = bucket.buffer._version
        self._next += 1
        return work

    def _synchronize(self) -> None:
        """Backward ended: launch, in order, the buckets not yet launched (unused parameters; hooked per bucket, also
        those whose count failed), then wait for all.

        Hooked per bucket, the count only decided when to send; this decides whether what was sent was whole: a
        bucket whose buffer changed after it was sent, or one of whose `.grad`s is no longer its view, may have
        missed a gradient, which is an error raised once every reduction landed. After a failed count or such an
        error, every gradient is hooked from the next step on."""
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        late = [j for j, version in self._sent.items() if not self.buckets[j].sent_whole(version)]
        comm.wait_all(self._works)
        if self._per_bucket and (late or self._unproven):
            self._hook_each(self._hooked)  # the gradients did not come as planned: one hook per gradient from now on
        if late:
            names = {id(p): n for n, p in self.module.named_parameters()}
            held = [names.get(id(p), "?") for p in self.buckets[late[0]].params]
            raise RuntimeError(
                f"{type(self).__name__}: bucket {late[0]} (of {', '.join(held[:3])}{', ...' if len(held) > 3 else ''})"
                " changed after the bucket was sent, or one of its .grads is no longer its view, so its average may "
                f"miss a gradient: a parameter's gradient arrived twice ({REENTRANT}), or a .grad was written or "
                "replaced during backward; "
                "from the next step the engine hooks every gradient again")
