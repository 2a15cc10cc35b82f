"""Lesson 08's checkers: the all-gather/reduce-scatter autograd function, the saved-tensor hooks, an FSDP class."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib import compat
from ddp_lib.check._collective_guard import CollectiveMismatch
from ddp_lib.check._runner import CheckResult, Mismatch, Property, collectives, learner_namespaces, max_diff, run_check
from ddp_lib.kit.memory import reachable_tensors
from ddp_lib.devices import comm_device
from ddp_lib.kit.models import ToyModel

#: weight shapes whose sizes do not all split evenly across 2 or 3 ranks (9, 20 and 7 elements)
SHAPES = [(3, 3), (4, 5), (7, 1)]


def _pad_chunk(t: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    """This rank's slice of `t` flattened and zero-padded to a multiple of ws (FSDP's layout)."""
    flat = t.detach().reshape(-1)
    return F.pad(flat, (0, -flat.numel() % ws)).chunk(ws)[rank].clone()


def _kinds(calls: list[str]) -> list[str]:
    return ["all_gather" if "all_gather" in c else "reduce_scatter" if "reduce_scatter" in c else c for c in calls]


def check_gather_scatter_fn(fn: type, timeout_s: float | None = None) -> CheckResult:
    """`fn.apply(shard, numel, shape)`: forward all-gathers the full weight, backward reduce-scatters its
    gradient into this rank's shard, averaged over ranks (weights that do not split evenly included)."""
    rank, ws, dev = dist.get_rank(), dist.get_world_size(), comm_device()

    def weights():
        g = torch.Generator().manual_seed(0)
        return [torch.randn(s, generator=g).to(dev) for s in SHAPES]

    def forward() -> float:
        return max(max_diff({"W": fn.apply(_pad_chunk(w, rank, ws), w.numel(), w.shape)}, {"W": w},
                            what=f"{tuple(w.shape)}: ") for w in weights())

    def backward() -> float:
        worst = 0.0
        for w in weights():
            x = torch.randn(2 * ws, w.shape[1], generator=torch.Generator().manual_seed(1)).to(dev)
            full = w.clone().requires_grad_()
            (x @ full.t()).pow(2).mean().backward()  # one process, the full batch
            shard = _pad_chunk(w, rank, ws).requires_grad_()
            W = fn.apply(shard, w.numel(), w.shape)
            (x.chunk(ws)[rank] @ W.t()).pow(2).mean().backward()  # this rank's part of the batch
            if shard.grad is None:
                raise Mismatch(f"{tuple(w.shape)}: the shard got no gradient")
            want = _pad_chunk(full.grad, rank, ws)
            if ws > 1 and not torch.allclose(shard.grad, want, atol=1e-5):
                local = torch.zeros_like(w).requires_grad_()
                (x.chunk(ws)[rank] @ (w + local).t()).pow(2).mean().backward()  # this rank's own gradient of W
                for factor, why in ((ws, "summed over ranks, not averaged: divide by world_size"),
                                    (1 / ws, "divided twice? (divide once, after the reduce-scatter)")):
                    if torch.allclose(shard.grad, factor * want, atol=1e-5):
                        raise Mismatch(f"{tuple(w.shape)}: the shard's gradient is {why}")
                if torch.allclose(shard.grad, _pad_chunk(local.grad, rank, ws), atol=1e-5) or \
                        torch.allclose(shard.grad, _pad_chunk(local.grad, rank, ws) / ws, atol=1e-5):
                    raise Mismatch(f"{tuple(w.shape)}: the shard's gradient is this rank's own slice: nothing was "
                                   "reduced across ranks")
            worst = max(worst, max_diff({"grad": shard.grad}, {"grad": want}, what=f"{tuple(w.shape)}: "))
        return worst

    def calls() -> None:
        w = weights()[0]
        shard = _pad_chunk(w, rank, ws).requires_grad_()
        W = fn.apply(shard, w.numel(), w.shape)
        fwd = _kinds(collectives())
        W.sum().backward()
        bwd = _kinds(collectives())[len(fwd):]
        if fwd != ["all_gather"] or bwd != ["reduce_scatter"]:
            raise Mismatch(f"forward issued {fwd or 'nothing'}, backward {bwd or 'nothing'}")

    return run_check("check_gather_scatter_fn", [
        Property("forward: the full weight", forward,
                 "gather into a buffer of shard.numel() * world_size, then drop the padding: buf[:numel].view(shape)"),
        Property("backward: my slice of the averaged gradient", backward,
                 "pad the gradient to a multiple of world_size, reduce-scatter it, divide by world_size",
                 needs=("forward: the full weight",)),
        Property("one all-gather forward, one reduce-scatter backward", calls,
                 "forward gathers, backward reduce-scatters: nothing else, no all-reduce",
                 needs=("forward: the full weight", "backward: my slice of the averaged gradient")),
    ], timeout_s, learner_namespaces(fn))


def check_saved_tensor_hooks(make_hooks: Callable, timeout_s: float | None = None) -> CheckResult:
    """`make_hooks(live, gather)` returns `(pack, unpack)` for `saved_tensors_hooks`: a tensor that lives in a
    gathered weight (`live`: storage address -> layer) is saved as a note, and `unpack` gathers it again with
    `gather(layer)` and returns the same view; any other tensor is kept as it is."""
    rank, ws, dev = dist.get_rank(), dist.get_world_size(), comm_device()

    def run() -> dict[str, Any]:
        torch.manual_seed(0)
        layers = [nn.Linear(6, 6, bias=False).to(dev) for _ in range(3)]
        shards = [_pad_chunk(m.weight, rank, ws).requires_grad_() for m in layers]
        live: dict[int, int] = {}
        gathered: list[int] = []
        stats: dict[str, Any] = {"backward_gathers": []}

        def gather(k: int) -> torch.Tensor:
            buf = torch.empty(shards[k].numel() * ws, device=dev)
            compat.all_gather_single(buf, shards[k].detach())
            live[buf.untyped_storage().data_ptr()] = k
            gathered.append(k)
            return buf[:36].view(6, 6)

        class Gather(torch.autograd.Function):
            @staticmethod
            def forward(ctx, shard, k):
                ctx.k = k
                return gather(k)

            @staticmethod
            def backward(ctx, grad):
                out = torch.empty(shards[ctx.k].numel(), device=dev)
                compat.reduce_scatter_single(out, F.pad(grad.reshape(-1), (0, out.numel() * ws - 36)))
                return out / ws, None

        learner_pack, learner_unpack = make_hooks(live, gather)
        stats["kept"], stats["kept_offsets"], stats["notes_for_others"] = 0, [], 0
        saved: dict[int, tuple] = {}  # id(note) -> the view autograd saved (the checker's copy, to name mistakes)

        def pack(t: torch.Tensor) -> Any:  # what the learner's pack keeps of a gathered weight
            out = learner_pack(t)
            held = [out] if torch.is_tensor(out) else [o for o in (out if isinstance(out, tuple) else ())
                                                       if torch.is_tensor(o)]
            if t.untyped_storage().data_ptr() not in live and not torch.is_tensor(out):
                stats["notes_for_others"] += 1
            if t.untyped_storage().data_ptr() in live:
                if any(h.numel() >= t.numel() for h in held):
                    stats["kept"] += 1
                    stats["kept_offsets"].append(t.storage_offset())
                saved[id(out)] = (out, tuple(t.shape), t.stride(), t.storage_offset(), t.detach().clone())
            return out

        def unpack(packed: Any) -> torch.Tensor:  # the learner's unpack, compared with the view that was saved
            try:
                got = learner_unpack(packed)
            except NotImplementedError:
                raise
            except Exception as e:  # noqa: BLE001 - said as the mistake it usually is
                raise Mismatch(f"unpack raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}") from None
            rec = saved.get(id(packed))
            if rec is None or rec[0] is not packed:
                return got
            _, shape, stride, offset, want = rec
            if not torch.is_tensor(got) or tuple(got.shape) != shape:
                raise Mismatch(f"unpack returned {list(got.shape) if torch.is_tensor(got) else type(got).__name__} "
                               f"for a saved view of shape {list(shape)}: rebuild that view, not the whole weight")
            if not torch.equal(got.detach(), want):
                if got.stride() != stride:
                    why = f"stride {got.stride()} where autograd saved {stride} (view(shape) loses a transpose)"
                elif got.storage_offset() != offset:
                    why = f"storage offset {got.storage_offset()} where autograd saved a view at offset {offset}"
                else:
                    why = "other values than the view autograd saved"
                raise Mismatch(f"unpack returned a tensor of shape {list(shape)} with {why}")
            return got

        x = torch.randn(2 * ws, 6, generator=torch.Generator().manual_seed(2)).to(dev)
        h = x.chunk(ws)[rank]
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            for k in range(3):
                W = Gather.apply(shards[k], k)
                if k == 2:  # used in two halves, as a fused weight is split: saved views at offsets 0 and 18
                    h = torch.tanh(torch.cat([h @ W[:3].t(), h @ W[3:].t()], 1))
                else:
                    h = torch.tanh(h @ W.t())
                live.clear()  # the layer ran: its full weight is "freed" (only a note may keep it)
        loss = h.pow(2).mean()
        n_before = len(gathered)
        loss.backward()
        stats["backward_gathers"] = sorted(set(gathered[n_before:]))
        plain = x
        for m in layers:
            plain = torch.tanh(m(plain))
        plain.pow(2).mean().backward()
        stats["grads"] = ({f"w{k}": s.grad for k, s in enumerate(shards)},
                          {f"w{k}": _pad_chunk(m.weight.grad, rank, ws) for k, m in enumerate(layers)})
        return stats

    def equal() -> float:
        s = run()
        if s["notes_for_others"]:
            raise Mismatch(f"pack turned {s['notes_for_others']} saved tensors that are not gathered weights "
                           "(activations) into notes: return a tensor whose storage is not in `live` as it is")
        got, want = s["grads"]
        return max_diff(got, want)

    def freed() -> None:
        s = run()
        if s["kept"]:
            inside = " (every one a view starting inside its storage: look up t.untyped_storage().data_ptr(), " \
                "not t.data_ptr())" if all(s["kept_offsets"]) else ""
            raise Mismatch(f"pack kept {s['kept']} gathered weights (or copies) from forward to backward{inside}")
        if s["backward_gathers"] != [1, 2]:  # layers 1 and 2 save their weight; layer 0's input needs no gradient
            raise Mismatch(f"backward gathered the weights of layers {s['backward_gathers']}, expected [1, 2]")

    return run_check("check_saved_tensor_hooks", [
        Property("gradients equal one process", equal,
                 "the note keeps t.shape, t.stride() and t.storage_offset(); unpack returns "
                 "gather(layer).as_strided(shape, stride, offset): the same view autograd saved"),
        Property("weights freed between forward and backward", freed,
                 "pack looks up t.untyped_storage().data_ptr() (the storage, not t.data_ptr(): a view may start "
                 "inside it) and returns a note holding no tensor", needs=("gradients equal one process",)),
    ], timeout_s, learner_namespaces(make_hooks))


def _models() -> list[Callable[[], nn.Module]]:
    """Two shapes; the first has weights of 35, 49 and 21 elements (uneven at 2 and 3 ranks)."""
    return [lambda: ToyModel(5, 7, 3, depth=2), lambda: ToyModel(8, 16, 4, depth=3)]


def check_fsdp(cls: type, timeout_s: float | None = None) -> CheckResult:
    """`cls(module, compute_dtype=None)` trains like one process on the full batch, holds shards, frees weights;
    it has `finish_gradient_synchronization()` and `gather_full_params()` ({name: full tensor})."""
    rank, ws, dev = dist.get_rank(), dist.get_world_size(), comm_device()

    def batches(width: int, classes: int):
        g = torch.Generator().manual_seed(3)
        return [(torch.randn(2 * ws, width, generator=g).to(dev), torch.randint(0, classes, (2 * ws,), generator=g)
                 .to(dev)) for _ in range(3)]

    def train(make, sharded: bool, steps: int = 3):
        torch.manual_seed(0 if not sharded else rank)  # construction must broadcast rank 0's weights
        model = make().to(dev)
        engine = cls(model, compute_dtype=None) if sharded else model
        opt = torch.optim.SGD(engine.parameters(), lr=0.2, momentum=0.9)
        for x, y in batches(model.layers[0].in_features, model.head.out_features)[:steps]:
            if sharded:
                x, y = x.chunk(ws)[rank], y.chunk(ws)[rank]
            opt.zero_grad()
            F.cross_entropy(engine(x), y).backward()
            if sharded:
                engine.finish_gradient_synchronization()
            opt.step()
        return engine, model

    def uneven(e: CollectiveMismatch) -> Mismatch:
        if e.secondary or not any(k in str(e) for k in ("all_gather", "reduce_scatter")):
            raise e
        return Mismatch(f"{e}: the shards differ in size across ranks: pad every flattened weight to a multiple of "
                        "world_size, so that every rank's shard has the same size")

    def equal() -> float:
        torch.manual_seed(rank)  # each rank's own initial weights: construction must make them rank 0's
        try:
            engine = cls(_models()[0]().to(dev), compute_dtype=None)
            full = engine.gather_full_params()
            torch.manual_seed(0)
            max_diff(full, dict(_models()[0]().to(dev).named_parameters()))
            engine, _ = train(_models()[0], True, steps=1)
            got = engine.gather_full_params()
        except CollectiveMismatch as e:
            raise uneven(e) from None
        except Mismatch as e:
            raise Mismatch(f"right after construction, gather_full_params() is not rank 0's model ({e}): broadcast "
                           "rank 0's parameters and buffers before sharding", e.diff) from None
        torch.manual_seed(0)
        start = dict(_models()[0]().to(dev).named_parameters())
        want = dict(train(_models()[0], False, steps=1)[1].named_parameters())
        summed, other = [], []
        for n, w in want.items():
            d_got, d_want = got[n].detach() - start[n].detach(), w.detach() - start[n].detach()
            if not torch.allclose(d_got, d_want, atol=1e-6):
                (summed if ws > 1 and torch.allclose(d_got, ws * d_want, atol=1e-6) else other).append(n)
        if summed:
            raise Mismatch(f"after 1 step, the update of {', '.join(summed)} is {ws}x one process's: those gradients "
                           "were summed over ranks, not averaged (divide by world_size)")
        if other:
            raise Mismatch(f"after 1 step, {', '.join(other)} differ from one process's update (the others are "
                           "right): average the gradients of every parameter, sharded or replicated")
        worst = 0.0
        for k, make in enumerate(_models()):
            torch.manual_seed(0)
            engine, _ = train(make, True)
            _, plain = train(make, False)
            worst = max(worst, max_diff(engine.gather_full_params(), dict(plain.named_parameters()),
                                        what=f"model {k + 1}, after 3 steps: "))
        return worst

    def shards() -> None:
        engine, _ = train(_models()[1], True)
        full = sum(p.numel() for p in _models()[1]().parameters())
        mine = sum(p.numel() for p in engine.parameters())
        if ws > 1 and mine > full / ws + 64:  # the replicated biases (16 + 16 + 16 + 4) may stay whole
            raise Mismatch(f"parameters() holds {mine} elements on this rank; the full model has {full}")
        params = list(engine.parameters())
        skip = {id(p) for p in params} | {p.data_ptr() for p in params} | \
            {p.grad.data_ptr() for p in params if p.grad is not None}
        held = sum(t.numel() for t in reachable_tensors(vars(engine), skip) if t.numel() > 1)  # modules are skipped
        if held > 16 * 16:  # more than one full weight of this model kept after the step
            raise Mismatch(f"{held} elements of full-size tensors still reachable from the object after the step")

    return run_check("check_fsdp", [
        Property("equal to one process", equal,
                 "broadcast rank 0's weights before sharding; pad every weight to a multiple of world_size; "
                 "average (divide by world_size) both the reduce-scattered and the all-reduced gradients"),
        Property("holds shards, frees full weights", shards,
                 "parameters() must be the shards; drop gathered weights after use (saved-tensor hooks)",
                 needs=("equal to one process",)),
    ], timeout_s, learner_namespaces(cls))
