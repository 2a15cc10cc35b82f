"""Mutation suites of the checkers of lessons 05, 07 and 08, on 2 gloo ranks in ONE spawned group.

For each checker: mistakes the lesson's text warns about fail the property they concern (asserted by name),
with one diagnosis (the properties that depend on it read "not checked"), and right answers written another
way pass. Checkers: check_overlap_hook, check_bucket_plan and check_bucket_engine (05), check_zero1 (07),
check_gather_scatter_fn, check_saved_tensor_hooks and check_fsdp (08).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.launch import spawn

from _answers import BucketsLaunchAtEnd, HandBuckets, HandLaunchInFinish, HandOverlap, plan_buckets
from _mutations import run_suites, suite_tests

LIMIT_S = 8.0  # the checks' timeout here (60 s by default)


# ------------------------------------------------------------------------- lesson 05: overlap by hand
class OverlapFutures(HandOverlap):  # right, another way: AVG op, futures, wait_all, the list swapped out
    def _ready(self, p):
        op = dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM
        work = dist.all_reduce(p.grad, op=op, async_op=True)
        fut = work.get_future()
        if op == dist.ReduceOp.SUM:
            fut = fut.then(lambda f, g=p.grad: g.div_(dist.get_world_size()))
        self.handles.append(fut)

    def finish(self) -> int:
        futs, self.handles = self.handles, []
        torch.futures.wait_all(futs)
        return len(futs)


class OverlapNoDivision(HandOverlap):
    def _ready(self, p):
        self.handles.append(dist.all_reduce(p.grad, async_op=True))


class OverlapDividesTwice(HandOverlap):  # divided in the hook, and again once the handles are waited
    def _ready(self, p):
        super()._ready(p)
        self.grads = getattr(self, "grads", []) + [p.grad]

    def finish(self) -> int:
        n = super().finish()
        for g in self.grads:
            g.div_(dist.get_world_size())
        self.grads = []
        return n


class OverlapBlockingHook(HandOverlap):  # in the hook, but without async_op: backward waits for each
    def _ready(self, p):
        p.grad.div_(dist.get_world_size())
        dist.all_reduce(p.grad)
        self.handles.append(None)

    def finish(self) -> int:
        n, self.handles = len(self.handles), []
        return n


class OverlapWaitsInHook(HandOverlap):  # async_op=True, then waited for at once: backward stalls on each
    def _ready(self, p):
        p.grad.div_(dist.get_world_size())
        handle = dist.all_reduce(p.grad, async_op=True)
        handle.wait()
        self.handles.append(handle)


class OverlapDividesInFinish(HandOverlap):  # right, another way: sum in the hook, divide once it has landed
    def _ready(self, p):
        self.handles.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish(self) -> int:
        for p, h in reversed(self.handles):  # any order: every handle is waited for before its grad is read
            h.get_future().wait()
            p.grad.div_(dist.get_world_size())
        n, self.handles = len(self.handles), []
        return n


class OverlapForgetsCount(HandOverlap):
    def finish(self):
        for h in self.handles:
            h.wait()
        self.handles = []


class OverlapKeepsHandles(HandOverlap):  # waits, counts, but never empties the list
    def finish(self) -> int:
        for h in self.handles:
            h.wait()
        return len(self.handles)


class OverlapRank1Reversed(HandOverlap):  # lesson 05's exercise 1: rank 1 collects, then launches in reverse in finish
    def _ready(self, p):
        if dist.get_rank() == 1:
            p.grad.div_(dist.get_world_size())
            self.handles.append(p.grad)
        else:
            super()._ready(p)

    def finish(self) -> int:
        if dist.get_rank() == 1:
            self.handles = [dist.all_reduce(g, async_op=True) for g in reversed(self.handles)]
        return super().finish()


HOOK = {"right: solution": ("check_overlap_hook", lambda: HandOverlap),
        "right: futures, wait_all": ("check_overlap_hook", lambda: OverlapFutures),
        "no division": ("check_overlap_hook", lambda: OverlapNoDivision),
        "divides twice": ("check_overlap_hook", lambda: OverlapDividesTwice),
        "launch in finish": ("check_overlap_hook", lambda: HandLaunchInFinish),
        "right: divides in finish": ("check_overlap_hook", lambda: OverlapDividesInFinish),
        "blocking all-reduce in the hook": ("check_overlap_hook", lambda: OverlapBlockingHook),
        "waits in the hook": ("check_overlap_hook", lambda: OverlapWaitsInHook),
        "returns no count": ("check_overlap_hook", lambda: OverlapForgetsCount),
        "handles kept across steps": ("check_overlap_hook", lambda: OverlapKeepsHandles),
        "rank 1 in reverse order": ("check_overlap_hook", lambda: OverlapRank1Reversed)}


# --------------------------------------------------------------------------- lesson 05: the bucket plan
def plan_closed_list(params, cap_bytes, first_cap_bytes):  # right, another way: close into a list, flush at the end
    closed, open_, size = [], [], 0
    for p in params[::-1]:
        open_.append(p)
        size += p.nelement() * p.element_size()
        if size >= (cap_bytes if closed else first_cap_bytes):
            closed.append(open_)
            open_, size = [], 0
    return closed + ([open_] if open_ else [])


def plan_forward_order(params, cap_bytes, first_cap_bytes):
    return plan_buckets(list(reversed(params)), cap_bytes, first_cap_bytes)


def plan_strict(params, cap_bytes, first_cap_bytes):  # > where the rule says >=
    buckets, size = [[]], 0
    for p in reversed(params):
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
        if size > (first_cap_bytes if len(buckets) == 1 else cap_bytes):
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


def plan_ignores_first_cap(params, cap_bytes, first_cap_bytes):
    return plan_buckets(params, cap_bytes, cap_bytes)


def plan_elements(params, cap_bytes, first_cap_bytes):  # counts elements against a cap in bytes
    buckets, size = [[]], 0
    for p in reversed(params):
        buckets[-1].append(p)
        size += p.numel()
        if size >= (first_cap_bytes if len(buckets) == 1 else cap_bytes):
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


def plan_close_before_adding(params, cap_bytes, first_cap_bytes):  # closes when the next tensor would overflow
    buckets, size = [[]], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > (first_cap_bytes if len(buckets) == 1 else cap_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


PLAN = {"right: solution": ("check_bucket_plan", lambda: plan_buckets),
        "right: closed list": ("check_bucket_plan", lambda: plan_closed_list),
        "right: package": ("check_bucket_plan", lambda: lambda ps, cap, first: __import__(
            "ddp_lib.ddp.bucketed", fromlist=["x"]).assign_buckets(list(reversed(ps)), cap, first)),
        "forward order": ("check_bucket_plan", lambda: plan_forward_order),
        "> instead of >=": ("check_bucket_plan", lambda: plan_strict),
        "first cap ignored": ("check_bucket_plan", lambda: plan_ignores_first_cap),
        "elements, not bytes": ("check_bucket_plan", lambda: plan_elements),
        "closes before adding": ("check_bucket_plan", lambda: plan_close_before_adding)}


# ------------------------------------------------------------------------- lesson 05: the bucket engine
class BucketsForBreak(HandBuckets):  # right, another way: a for loop with break, futures, _unflatten_dense_tensors
    def _ready(self, p):
        self.pending[self.where[p]] -= 1
        for i in range(self.next, len(self.buckets)):
            if self.pending[i]:
                break
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            flat /= dist.get_world_size()
            self.flat.append((i, flat))
            self.handles.append(dist.all_reduce(flat, async_op=True).get_future())
            self.next = i + 1

    def finish(self) -> int:
        from torch._utils import _unflatten_dense_tensors

        torch.futures.wait_all(self.handles)
        for i, flat in self.flat:
            grads = [q.grad for q in self.buckets[i]]
            for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(new)
        n = len(self.handles)
        self.handles, self.flat = [], []
        self.reset()
        return n


class BucketsWhicheverReady(HandBuckets):  # launches the bucket that just completed, in any order
    def _ready(self, p):
        i = self.where[p]
        self.pending[i] -= 1
        if self.pending[i] == 0:
            self._launch(i)


class BucketsIf(HandBuckets):  # if where the lesson says while: a complete bucket behind the next one waits forever
    def _ready(self, p):
        self.pending[self.where[p]] -= 1
        if self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1


class BucketsNoReset(HandBuckets):  # the second step launches nothing
    def finish(self) -> int:
        for h in self.handles:
            h.wait()
        self._copy_back()
        n, self.handles, self.flat = len(self.handles), [], []
        return n


class BucketsNoDivision(HandBuckets):
    def _launch(self, i):
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]])
        self.flat.append((i, flat))
        self.handles.append(dist.all_reduce(flat, async_op=True))


class BucketsNoCopyBack(HandBuckets):  # the flat average never reaches .grad
    def _copy_back(self):
        pass


class BucketsKeepHandles(HandBuckets):  # waits and copies, but never empties the lists
    def finish(self) -> int:
        for h in self.handles:
            h.wait()
        self._copy_back()
        self.reset()
        return len(self.handles)


class BucketsWaitAtLaunch(HandBuckets):  # each bucket waited for as soon as it is launched: no overlap
    def _launch(self, i):
        super()._launch(i)
        self.handles[-1].wait()


class BucketsBlocking(HandBuckets):  # no async_op: each bucket's all-reduce blocks backward
    def _launch(self, i):
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]]).div_(dist.get_world_size())
        self.flat.append((i, flat))
        dist.all_reduce(flat)

    def finish(self) -> int:
        self._copy_back()
        n, self.flat = len(self.flat), []
        self.reset()
        return n


class BucketsWaitInReverse(HandBuckets):  # right, another way: waited for last to first, split back
    def finish(self) -> int:
        for h in reversed(self.handles):
            h.wait()
        for i, flat in self.flat:
            for p, chunk in zip(self.buckets[i], flat.split([p.numel() for p in self.buckets[i]])):
                p.grad.copy_(chunk.view_as(p.grad))
        n, self.handles, self.flat = len(self.handles), [], []
        self.reset()
        return n


RIGHT_BUCKETS = (HandBuckets, BucketsForBreak, BucketsWaitInReverse)
BUCKETS = {f"{'right: ' if c in RIGHT_BUCKETS else ''}{c.__name__}": ("check_bucket_engine", (lambda c=c: c))
           for c in (*RIGHT_BUCKETS, BucketsWhicheverReady, BucketsIf, BucketsNoReset, BucketsNoDivision,
                     BucketsNoCopyBack, BucketsLaunchAtEnd, BucketsKeepHandles, BucketsWaitAtLaunch, BucketsBlocking)}


# ------------------------------------------------------------------------------- lesson 07: ZeRO-1's step
def assign_shards(params, world_size):  # the lesson's assignment: largest first, onto the least loaded rank
    load, owner = [0] * world_size, {}
    for p in sorted(params, key=lambda p: -p.numel()):
        r = min(range(world_size), key=lambda i: (load[i], i))
        owner[p] = r
        load[r] += p.numel()
    return owner, load


class Zero1Sketch:  # the lesson's solution
    def __init__(self, params, optimizer_cls=torch.optim.AdamW, **kwargs):
        self.params = list(params)
        self.owner, _ = assign_shards(self.params, dist.get_world_size())
        mine = [p for p in self.params if self.owner[p] == dist.get_rank()]
        self.local = optimizer_cls(mine, **kwargs)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def owned(self, src):
        return [p.data for p in self.params if self.owner[p] == src]

    @torch.no_grad()
    def step(self):
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        self.local.step()
        for src in range(dist.get_world_size()):
            owned = self.owned(src)
            flat = _flatten_dense_tensors(owned)
            dist.broadcast(flat, src=src)
            for t, new in zip(owned, _unflatten_dense_tensors(flat, owned)):
                t.copy_(new)


class Zero1PerTensor(Zero1Sketch):  # right, another way: one broadcast per tensor, straight into the parameter
    @torch.no_grad()
    def step(self):
        self.local.step()
        for p in self.params:
            dist.broadcast(p.data, src=self.owner[p])


class Zero1SumOfZeros(Zero1Sketch):  # right, another way: zero what others own, one all-reduce sums the owners' values
    @torch.no_grad()
    def step(self):
        self.local.step()
        flat = torch.cat([p.data.reshape(-1) if self.owner[p] == dist.get_rank() else torch.zeros(p.numel())
                          for p in self.params])
        dist.all_reduce(flat)
        offset = 0
        for p in self.params:
            p.data.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class Zero1NoBroadcast(Zero1Sketch):  # each rank steps its shard and keeps the result to itself
    @torch.no_grad()
    def step(self):
        self.local.step()


class Zero1FromRank0(Zero1Sketch):  # every shard broadcast from rank 0, whoever owns it
    @torch.no_grad()
    def step(self):
        self.local.step()
        for p in self.params:
            dist.broadcast(p.data, src=0)


class Zero1NoCopyBack(Zero1Sketch):  # the broadcast lands in a flat copy that never reaches the parameters
    @torch.no_grad()
    def step(self):
        from torch._utils import _flatten_dense_tensors

        self.local.step()
        for src in range(dist.get_world_size()):
            dist.broadcast(_flatten_dense_tensors(self.owned(src)), src=src)


class Zero1OwnShardFirst(Zero1Sketch):  # each rank broadcasts its own shard first: the ranks' collectives differ
    @torch.no_grad()
    def step(self):
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        self.local.step()
        me, n = dist.get_rank(), dist.get_world_size()
        for src in [me] + [r for r in range(n) if r != me]:
            owned = self.owned(src)
            flat = _flatten_dense_tensors(owned)
            dist.broadcast(flat, src=src)
            for t, new in zip(owned, _unflatten_dense_tensors(flat, owned)):
                t.copy_(new)


class Zero1AllReduce(Zero1Sketch):  # all-reduce sums every rank's copy: the owner's new values plus stale ones
    @torch.no_grad()
    def step(self):
        self.local.step()
        for p in self.params:
            dist.all_reduce(p.data)


class Zero1FullOptimizer(Zero1Sketch):  # right values, but the whole optimizer (all its state) on every rank
    def __init__(self, params, optimizer_cls=torch.optim.AdamW, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.local = optimizer_cls(self.params, **kwargs)


class Zero1MasterCopies(Zero1Sketch):  # keeps an fp32 copy of every parameter, owned or not
    def __init__(self, params, optimizer_cls=torch.optim.AdamW, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.master = [p.detach().clone() for p in self.params]


ZERO = {f"{'right: ' if c in (Zero1Sketch, Zero1PerTensor, Zero1SumOfZeros) else ''}{c.__name__}":
        ("check_zero1", (lambda c=c: c))
        for c in (Zero1Sketch, Zero1PerTensor, Zero1SumOfZeros, Zero1NoBroadcast, Zero1FromRank0, Zero1NoCopyBack,
                  Zero1OwnShardFirst, Zero1AllReduce, Zero1FullOptimizer, Zero1MasterCopies)}
ZERO["right: package"] = ("check_zero1", lambda: __import__("ddp_lib.zero", fromlist=["x"]).ShardedOptimizer)


# ----------------------------------------------------------------------- lesson 08: saved-tensor hooks
def saved_tensor_hooks(live, gather, key=lambda t: t.untyped_storage().data_ptr(), keep=False, rebuild="as_strided"):
    """The lesson's solution, with switches for the planted mistakes."""
    def pack(t):
        layer = live.get(key(t))
        if layer is None:
            return t
        return (layer, t.shape, t.stride(), t.storage_offset()) + ((t,) if keep else ())

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        layer, shape, stride, offset = packed[:4]
        full = gather(layer)
        if rebuild == "as_strided":
            return full.as_strided(shape, stride, offset)
        if rebuild == "no offset":
            return full.as_strided(shape, stride)
        if rebuild == "view":
            return full.view(shape)
        return full.t()  # "a Linear saves weight.t()"

    return pack, unpack


def hooks_note_dict(live, gather):  # right, another way: a dict note, torch.as_strided
    def pack(t):
        storage = t.untyped_storage().data_ptr()
        if storage not in live:
            return t
        return {"layer": live[storage], "size": tuple(t.size()), "stride": t.stride(), "offset": t.storage_offset()}

    def unpack(note):
        if torch.is_tensor(note):
            return note
        return torch.as_strided(gather(note["layer"]), note["size"], note["stride"], note["offset"])

    return pack, unpack


def hooks_note_everything(live, gather):  # every saved tensor becomes a note of layer 0 (a default in the lookup)
    pack, unpack = saved_tensor_hooks(live, gather)

    def pack_all(t):
        return (live.get(t.untyped_storage().data_ptr(), 0), t.shape, t.stride(), t.storage_offset())

    return pack_all, unpack


HOOKS = {
    "right: solution": ("check_saved_tensor_hooks", lambda: saved_tensor_hooks),
    "right: dict note": ("check_saved_tensor_hooks", lambda: hooks_note_dict),
    "storage offset dropped": ("check_saved_tensor_hooks",
                               lambda: lambda live, g: saved_tensor_hooks(live, g, rebuild="no offset")),
    "keyed on t.data_ptr()": ("check_saved_tensor_hooks",
                              lambda: lambda live, g: saved_tensor_hooks(live, g, key=lambda t: t.data_ptr())),
    "view(shape)": ("check_saved_tensor_hooks", lambda: lambda live, g: saved_tensor_hooks(live, g, rebuild="view")),
    "always weight.t()": ("check_saved_tensor_hooks", lambda: lambda live, g: saved_tensor_hooks(live, g, rebuild="t")),
    "note keeps the tensor": ("check_saved_tensor_hooks",
                              lambda: lambda live, g: saved_tensor_hooks(live, g, keep=True)),
    "every tensor a note": ("check_saved_tensor_hooks", lambda: hooks_note_everything),
}


# ------------------------------------------------------------- lesson 08: all-gather forward, reduce-scatter back
def _gather_scatter(pad=True, divide=1, keep_padding=False, buffer="padded", reduce=True):
    """The lesson's GatherSketch, with switches for the planted mistakes."""
    from ddp_lib import compat

    class GatherSketch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, shard, numel, shape):
            ws = dist.get_world_size()
            ctx.numel = numel
            buf = torch.empty(shard.numel() * ws if buffer == "padded" else numel)
            compat.all_gather_single(buf, shard)
            return buf.view(shape) if keep_padding else buf[:numel].view(shape)

        @staticmethod
        def backward(ctx, grad):
            ws = dist.get_world_size()
            flat = F.pad(grad.reshape(-1), (0, -ctx.numel % ws)) if pad else grad.reshape(-1)
            out = torch.empty(flat.numel() // ws)
            if reduce:
                compat.reduce_scatter_single(out, flat)
            else:
                out = flat.chunk(ws)[dist.get_rank()].clone()
            return out / ws ** divide, None, None

    return GatherSketch


class GatherScatterLists(torch.autograd.Function):  # right, another way: divide first, list all-gather, torch.cat
    @staticmethod
    def forward(ctx, shard, numel, shape):
        ctx.numel = numel
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, shard)
        return torch.cat(parts)[:numel].reshape(shape)

    @staticmethod
    def backward(ctx, grad):
        from ddp_lib import compat

        ws = dist.get_world_size()
        chunk = -(-ctx.numel // ws)
        flat = torch.zeros(chunk * ws)
        flat[:ctx.numel] = grad.reshape(-1) / ws
        out = torch.empty(chunk)
        compat.reduce_scatter_single(out, flat)
        return out, None, None


class GatherAllReduce(torch.autograd.Function):  # the right values through an all-reduce and a slice
    @staticmethod
    def forward(ctx, shard, numel, shape):
        return _gather_scatter().forward(ctx, shard, numel, shape)

    @staticmethod
    def backward(ctx, grad):
        ws = dist.get_world_size()
        flat = F.pad(grad.reshape(-1), (0, -ctx.numel % ws))
        dist.all_reduce(flat)
        return flat.chunk(ws)[dist.get_rank()] / ws, None, None


GATHER = {
    "right: solution": ("check_gather_scatter_fn", lambda: _gather_scatter()),
    "right: lists, divide first": ("check_gather_scatter_fn", lambda: GatherScatterLists),
    "no division": ("check_gather_scatter_fn", lambda: _gather_scatter(divide=0)),
    "divides twice": ("check_gather_scatter_fn", lambda: _gather_scatter(divide=2)),
    "no padding in backward": ("check_gather_scatter_fn", lambda: _gather_scatter(pad=False)),
    "padding kept in forward": ("check_gather_scatter_fn", lambda: _gather_scatter(keep_padding=True)),
    "buffer of numel": ("check_gather_scatter_fn", lambda: _gather_scatter(buffer="numel")),
    "own slice, not reduced": ("check_gather_scatter_fn", lambda: _gather_scatter(reduce=False)),
    "all-reduce, then a slice": ("check_gather_scatter_fn", lambda: GatherAllReduce),
}


# ------------------------------------------------------------------------- lesson 08: an FSDP of one's own
class SketchFSDP(torch.nn.Module):
    """A learner's FSDP for the check's MLPs: every Linear weight a padded flat shard, gathered by the lesson's
    autograd function just before its layer runs and dropped after; biases replicated and all-reduced."""

    broadcast, divide, pad, sync_bias, keep = True, 1, True, True, False

    def __init__(self, module, compute_dtype=None):
        super().__init__()
        ws, rank = dist.get_world_size(), dist.get_rank()
        if self.broadcast:
            for t in module.state_dict().values():
                dist.broadcast(t, src=0)
        self.module, self.fn, self.meta, self.kept = module, _gather_scatter(divide=self.divide), {}, {}
        self.shards = torch.nn.ParameterDict()
        for name, m in module.named_modules():
            if isinstance(m, torch.nn.Linear):
                w, key = m.weight.detach(), name.replace(".", "_")
                flat = F.pad(w.reshape(-1), (0, -w.numel() % ws)) if self.pad else w.reshape(-1)
                self.shards[key] = torch.nn.Parameter(flat.tensor_split(ws)[rank].clone())
                self.meta[key] = (name, w.numel(), w.shape)
                del m.weight
                m.register_forward_pre_hook(lambda mod, args, key=key: self._gather(mod, key))
                m.register_forward_hook(lambda mod, args, out: delattr(mod, "weight"))

    def _gather(self, mod, key):
        _, numel, shape = self.meta[key]
        mod.weight = self.fn.apply(self.shards[key], numel, shape)
        if self.keep:
            self.kept[key] = mod.weight

    def forward(self, x):
        return self.module(x)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():  # the replicated biases: averaged as in DDP
            if self.sync_bias:
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()

    @torch.no_grad()
    def gather_full_params(self):
        from ddp_lib import compat

        out = {n: p.detach().clone() for n, p in self.module.named_parameters()}
        for key, shard in self.shards.items():
            name, numel, shape = self.meta[key]
            buf = torch.empty(shard.numel() * dist.get_world_size())
            compat.all_gather_single(buf, shard.detach())
            out[f"{name}.weight"] = buf[:numel].view(shape).clone()
        return out


class FSDPNoBroadcast(SketchFSDP):
    broadcast = False


class FSDPNoAverage(SketchFSDP):
    divide = 0


class FSDPBiasNotSynced(SketchFSDP):
    sync_bias = False


class FSDPNoPadding(SketchFSDP):  # uneven weights split into unequal shards: the ranks gather different sizes
    pad = False


class FSDPKeepsWeights(SketchFSDP):  # every gathered weight kept in a dict "for backward"
    keep = True


FSDP_CASES = {f"{'right: ' if c is SketchFSDP else ''}{c.__name__}": ("check_fsdp", (lambda c=c: c))
              for c in (SketchFSDP, FSDPNoBroadcast, FSDPNoAverage, FSDPBiasNotSynced, FSDPNoPadding,
                        FSDPKeepsWeights)}
FSDP_CASES["right: package"] = ("check_fsdp", lambda: __import__("ddp_lib.fsdp", fromlist=["x"]).FSDP)


SUITES = {"hook": HOOK, "plan": PLAN, "buckets": BUCKETS, "zero": ZERO, "saved": HOOKS, "gather": GATHER,
          "fsdp": FSDP_CASES}


# ------------------------------------------------------------------------------------------ the ranks
def run_all(suites: list[str] | None = None) -> dict:
    """On each rank: every case of `suites` (default: all) in order; then one all-reduce on the default group."""
    import ddp_lib.check as check

    checkers = {"check_overlap_hook": check.check_overlap_hook, "check_bucket_plan": check.check_bucket_plan,
                "check_bucket_engine": check.check_bucket_engine, "check_zero1": check.check_zero1,
                "check_saved_tensor_hooks": check.check_saved_tensor_hooks,
                "check_gather_scatter_fn": check.check_gather_scatter_fn, "check_fsdp": check.check_fsdp}
    return run_suites(SUITES, checkers, LIMIT_S, suites)


@pytest.fixture(scope="module")
def results():
    return spawn(run_all, 2, backend="gloo", timeout_s=300)


def test_no_check_runs_past_its_limit(results):
    slow = {k: round(v["seconds"], 1) for k, v in results[0].items() if k != "group" and v["seconds"] > LIMIT_S}
    assert not slow, slow


MISTAKES = [  # (suite, planted mistake, the property it fails, words of its diagnosis)
    ("hook", "no division", "equal to one process", "summed, not divided"),
    ("hook", "divides twice", "equal to one process", "divided twice?"),
    ("hook", "launch in finish", "collectives start during backward", "no collective was issued during backward"),
    ("hook", "blocking all-reduce in the hook", "collectives start during backward", "no async_op=True"),
    ("hook", "waits in the hook", "collectives start during backward", "wait() call(s) during backward"),
    ("hook", "returns no count", "one all-reduce per gradient, counted, step after step", "returned None"),
    ("hook", "handles kept across steps", "one all-reduce per gradient, counted, step after step",
     "the handles of step 1 were kept"),
    ("hook", "rank 1 in reverse order", "equal to one process", "differs across ranks"),
    ("plan", "forward order", "same plan as torch DDP's rule", "walk reversed(params)"),
    ("plan", "> instead of >=", "a bucket exactly at the cap closes", "> where the rule is >="),
    ("plan", "first cap ignored", "small first bucket", "instead of first_cap_bytes"),
    ("plan", "elements, not bytes", "same plan as torch DDP's rule", "caps are in bytes"),
    ("plan", "closes before adding", "same plan as torch DDP's rule", "expected 2"),
    ("buckets", "BucketsWhicheverReady", "buckets launched in order, whatever order gradients arrive in",
     "differs across ranks"),
    ("buckets", "BucketsIf", "buckets launched in order, whatever order gradients arrive in", "differs across ranks"),
    ("buckets", "BucketsNoReset", "equal to one process, step after step", "step 1 is right, a later step is not"),
    ("buckets", "BucketsNoDivision", "equal to one process, step after step", "summed, not divided"),
    ("buckets", "BucketsNoCopyBack", "equal to one process, step after step", "this rank's own"),
    ("buckets", "BucketsLaunchAtEnd", "buckets start during backward", "no bucket was launched during backward"),
    ("buckets", "BucketsKeepHandles", "one all-reduce per bucket, counted", "step 2 counted step 1's handles"),
    ("buckets", "BucketsWaitAtLaunch", "buckets start during backward", "wait() call(s) during backward"),
    ("buckets", "BucketsBlocking", "buckets start during backward", "no async_op=True"),
    ("zero", "Zero1NoBroadcast", "equal to the unsharded optimizer", "still hold their initial values"),
    ("zero", "Zero1FromRank0", "equal to the unsharded optimizer", "src=owner"),
    ("zero", "Zero1NoCopyBack", "equal to the unsharded optimizer", "copy them back"),
    ("zero", "Zero1OwnShardFirst", "equal to the unsharded optimizer", "differs across ranks"),
    ("zero", "Zero1AllReduce", "equal to the unsharded optimizer", "an all-reduce sums the replicas"),
    ("zero", "Zero1FullOptimizer", "state is this rank's shard only", "the full state is"),
    ("zero", "Zero1MasterCopies", "state is this rank's shard only", "the full state is"),
    ("saved", "storage offset dropped", "gradients equal one process", "saved a view at offset 18"),
    ("saved", "keyed on t.data_ptr()", "weights freed between forward and backward", "not t.data_ptr()"),
    ("saved", "view(shape)", "gradients equal one process", "unpack raised RuntimeError"),
    ("saved", "always weight.t()", "gradients equal one process", "for a saved view of shape [6, 3]"),
    ("saved", "note keeps the tensor", "weights freed between forward and backward", "pack kept 3 gathered weights"),
    ("saved", "every tensor a note", "gradients equal one process", "(activations) into notes"),
    ("gather", "no division", "backward: my slice of the averaged gradient", "summed over ranks, not averaged"),
    ("gather", "divides twice", "backward: my slice of the averaged gradient", "divided twice?"),
    ("gather", "no padding in backward", "backward: my slice of the averaged gradient",
     "pad the input to a multiple of world_size"),
    ("gather", "padding kept in forward", "forward: the full weight", "invalid for input of size 10"),
    ("gather", "buffer of numel", "forward: the full weight", "world_size (2) x 5 = 10 are needed"),
    ("gather", "own slice, not reduced", "backward: my slice of the averaged gradient", "nothing was reduced"),
    ("gather", "all-reduce, then a slice", "one all-gather forward, one reduce-scatter backward", "['all_reduce']"),
    ("fsdp", "FSDPNoBroadcast", "equal to one process", "broadcast rank 0's parameters"),
    ("fsdp", "FSDPNoAverage", "equal to one process", "summed over ranks, not averaged"),
    ("fsdp", "FSDPBiasNotSynced", "equal to one process", "layers.0.bias, layers.1.bias, head.bias differ"),
    ("fsdp", "FSDPNoPadding", "equal to one process", "pad every flattened weight to a multiple of world_size"),
    ("fsdp", "FSDPKeepsWeights", "holds shards, frees full weights", "still reachable from the object"),
]


# what every mutation suite asserts on its results (one copy: tests/_mutations.py)
(test_same_verdict_on_every_rank_and_group_intact, test_right_answers_written_another_way_pass,
 test_planted_mistake_fails_its_property_with_one_diagnosis, test_suites_are_big_enough) = suite_tests(SUITES, MISTAKES)


def test_hints_agree_with_the_lessons(results):
    rows = results[0]["buckets", "BucketsIf"]["rows"]
    hint = rows["buckets launched in order, whatever order gradients arrive in"][2]
    assert "while, not if" in hint and "never whichever bucket is ready" in hint
    assert rows["one all-reduce per bucket, counted"][0] == "PASS"
    plan = results[0]["plan", "> instead of >="]["rows"]["a bucket exactly at the cap closes"][2]
    assert ">=" in plan
    hook = results[0]["hook", "blocking all-reduce in the hook"]["rows"]["collectives start during backward"][2]
    assert "async_op=True" in hook
    saved = results[0]["saved", "keyed on t.data_ptr()"]["rows"]["weights freed between forward and backward"][2]
    assert "untyped_storage().data_ptr()" in saved and "not t.data_ptr()" in saved


def test_a_missing_pad_is_said_before_gloo_sees_it(results):
    detail = results[0]["gather", "no padding in backward"]["rows"]["backward: my slice of the averaged gradient"][1]
    assert "outputShape" not in detail and "ValueError: reduce_scatter" in detail


def test_dependent_properties_wait_for_the_one_that_failed(results):
    rows = results[0]["buckets", "BucketsNoReset"]["rows"]
    waits = "needs equal to one process, step after step first"
    assert rows["buckets launched in order, whatever order gradients arrive in"][0] == "not checked"
    assert rows["one all-reduce per bucket, counted"][:2] == ("not checked", waits)
    assert results[0]["zero", "Zero1NoBroadcast"]["rows"]["state is this rank's shard only"][0] == "not checked"
