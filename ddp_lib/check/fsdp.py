"""Lesson 08's checkers: the all-gather/reduce-scatter autograd function and an FSDP class (the saved-tensor
hooks' checker is in fsdp_hooks.py)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib.check._collective_guard import CollectiveMismatch
from ddp_lib.check._runner import CheckResult, Mismatch, Property, collectives, learner_namespaces, max_diff, run_check
from ddp_lib.check.fsdp_hooks import _pad_chunk, check_saved_tensor_hooks  # noqa: F401 (lesson 08 imports it here)
from ddp_lib.kit.memory import reachable_tensors
from ddp_lib.devices import comm_device, needs_process_group
from ddp_lib.kit.models import ToyModel

#: weight shapes whose sizes do not all split evenly across 2 or 3 ranks (9, 20 and 7 elements)
SHAPES = [(3, 3), (4, 5), (7, 1)]


def _kinds(calls: list[str]) -> list[str]:
    return ["all_gather" if "all_gather" in c else "reduce_scatter" if "reduce_scatter" in c else c for c in calls]


def _uneven_weights(dev: torch.device) -> list[torch.Tensor]:
    """The checker's weights: SHAPES, seeded, on the ranks' device."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dev) for s in SHAPES]


def _gathered_weights(fn: type, rank: int, ws: int, dev: torch.device) -> float:
    """Forward: `fn.apply` of each weight's shard against the full weight."""
    return max(max_diff({"W": fn.apply(_pad_chunk(w, rank, ws), w.numel(), w.shape)}, {"W": w},
                        what=f"{tuple(w.shape)}: ") for w in _uneven_weights(dev))


def _shard_gradients(fn: type, rank: int, ws: int, dev: torch.device) -> float:
    """Backward: each shard's gradient against one process's full gradient, sliced; a wrong one named."""
    worst = 0.0
    for w in _uneven_weights(dev):
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
            _name_gradient_mistake(w, x, shard.grad, want, rank, ws)
        worst = max(worst, max_diff({"grad": shard.grad}, {"grad": want}, what=f"{tuple(w.shape)}: "))
    return worst


def _name_gradient_mistake(w: torch.Tensor, x: torch.Tensor, got: torch.Tensor, want: torch.Tensor, rank: int,
                           ws: int) -> None:
    """Raise the usual mistake a wrong shard gradient matches (a factor of ws, or no reduction), if any."""
    local = torch.zeros_like(w).requires_grad_()
    (x.chunk(ws)[rank] @ (w + local).t()).pow(2).mean().backward()  # this rank's own gradient of W
    for factor, why in ((ws, "summed over ranks, not averaged: divide by world_size"),
                        (1 / ws, "divided twice? (divide once, after the reduce-scatter)")):
        if torch.allclose(got, factor * want, atol=1e-5):
            raise Mismatch(f"{tuple(w.shape)}: the shard's gradient is {why}")
    own = _pad_chunk(local.grad, rank, ws)
    if torch.allclose(got, own, atol=1e-5) or torch.allclose(got, own / ws, atol=1e-5):
        raise Mismatch(f"{tuple(w.shape)}: the shard's gradient is this rank's own slice: nothing was "
                       "reduced across ranks")


def _one_gather_one_scatter(fn: type, rank: int, ws: int, dev: torch.device) -> None:
    """The collectives `fn` issues: one all-gather in forward, one reduce-scatter in backward."""
    w = _uneven_weights(dev)[0]
    shard = _pad_chunk(w, rank, ws).requires_grad_()
    W = fn.apply(shard, w.numel(), w.shape)
    fwd = _kinds(collectives())
    W.sum().backward()
    bwd = _kinds(collectives())[len(fwd):]
    if fwd != ["all_gather"] or bwd != ["reduce_scatter"]:
        raise Mismatch(f"forward issued {fwd or 'nothing'}, backward {bwd or 'nothing'}")


@needs_process_group
def check_gather_scatter_fn(fn: type, timeout_s: float | None = None) -> CheckResult:
    """`fn.apply(shard, numel, shape)`: forward all-gathers the full weight, backward reduce-scatters its
    gradient into this rank's shard, averaged over ranks (weights that do not split evenly included)."""
    on = (fn, dist.get_rank(), dist.get_world_size(), comm_device())
    return run_check("check_gather_scatter_fn", [
        Property("forward: the full weight", lambda: _gathered_weights(*on),
                 "gather into a buffer of shard.numel() * world_size, then drop the padding: buf[:numel].view(shape)"),
        Property("backward: my slice of the averaged gradient", lambda: _shard_gradients(*on),
                 "pad the gradient to a multiple of world_size, reduce-scatter it, divide by world_size",
                 needs=("forward: the full weight",)),
        Property("one all-gather forward, one reduce-scatter backward", lambda: _one_gather_one_scatter(*on),
                 "forward gathers, backward reduce-scatters: nothing else, no all-reduce",
                 needs=("forward: the full weight", "backward: my slice of the averaged gradient")),
    ], timeout_s, learner_namespaces(fn))


def _models() -> list[Callable[[], nn.Module]]:
    """Two shapes; the first has weights of 35, 49 and 21 elements (uneven at 2 and 3 ranks)."""
    return [lambda: ToyModel(5, 7, 3, depth=2), lambda: ToyModel(8, 16, 4, depth=3)]


def _batches(ws: int, width: int, classes: int, dev: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three full batches of 2 * ws samples, seeded."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2 * ws, width, generator=g).to(dev), torch.randint(0, classes, (2 * ws,), generator=g)
             .to(dev)) for _ in range(3)]


def _train(cls: type | None, make: Callable[[], nn.Module], rank: int, ws: int, dev: torch.device,
           steps: int = 3) -> tuple[nn.Module, nn.Module]:
    """(engine, module) after `steps` SGD steps: `cls` on this rank's part of each batch, or (cls None) one
    process on the full batch."""
    torch.manual_seed(0 if cls is None else rank)  # construction must broadcast rank 0's weights
    model = make().to(dev)
    engine = model if cls is None else cls(model, compute_dtype=None)
    opt = torch.optim.SGD(engine.parameters(), lr=0.2, momentum=0.9)
    for x, y in _batches(ws, model.layers[0].in_features, model.head.out_features, dev)[:steps]:
        if cls is not None:
            x, y = x.chunk(ws)[rank], y.chunk(ws)[rank]
        opt.zero_grad()
        F.cross_entropy(engine(x), y).backward()
        if cls is not None:
            engine.finish_gradient_synchronization()
        opt.step()
    return engine, model


def _uneven(e: CollectiveMismatch) -> Mismatch:
    """A desynchronised all-gather or reduce-scatter, said as the shards' sizes differing (else re-raised)."""
    if e.secondary or not any(k in str(e) for k in ("all_gather", "reduce_scatter")):
        raise e
    return Mismatch(f"{e}: the shards differ in size across ranks: pad every flattened weight to a multiple of "
                    "world_size, so that every rank's shard has the same size")


def _one_step(cls: type, rank: int, ws: int, dev: torch.device) -> dict[str, torch.Tensor]:
    """The full parameters after one step, once construction is seen to start from rank 0's model."""
    torch.manual_seed(rank)  # each rank's own initial weights: construction must make them rank 0's
    try:
        engine = cls(_models()[0]().to(dev), compute_dtype=None)
        full = engine.gather_full_params()
        torch.manual_seed(0)
        max_diff(full, dict(_models()[0]().to(dev).named_parameters()))
        engine, _ = _train(cls, _models()[0], rank, ws, dev, steps=1)
        return engine.gather_full_params()
    except CollectiveMismatch as e:
        raise _uneven(e) from None
    except Mismatch as e:
        raise Mismatch(f"right after construction, gather_full_params() is not rank 0's model ({e}): broadcast "
                       "rank 0's parameters and buffers before sharding", e.diff) from None


def _name_update_mistake(got: dict[str, torch.Tensor], rank: int, ws: int, dev: torch.device) -> None:
    """Raise if one step's update differs from one process's: summed, not averaged, or wrong for some."""
    torch.manual_seed(0)
    start = dict(_models()[0]().to(dev).named_parameters())
    want = dict(_train(None, _models()[0], rank, ws, dev, steps=1)[1].named_parameters())
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


def _fsdp_equal(cls: type, rank: int, ws: int, dev: torch.device) -> float:
    """One step named if wrong, then both models after 3 steps against one process."""
    _name_update_mistake(_one_step(cls, rank, ws, dev), rank, ws, dev)
    worst = 0.0
    for k, make in enumerate(_models()):
        torch.manual_seed(0)
        engine, _ = _train(cls, make, rank, ws, dev)
        _, plain = _train(None, make, rank, ws, dev)
        worst = max(worst, max_diff(engine.gather_full_params(), dict(plain.named_parameters()),
                                    what=f"model {k + 1}, after 3 steps: "))
    return worst


def _fsdp_shards(cls: type, rank: int, ws: int, dev: torch.device) -> None:
    """parameters() are shards; no more than one full weight reachable from the object after a step."""
    engine, _ = _train(cls, _models()[1], rank, ws, dev)
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


@needs_process_group
def check_fsdp(cls: type, timeout_s: float | None = None) -> CheckResult:
    """`cls(module, compute_dtype=None)` trains like one process on the full batch, holds shards, frees weights;
    it has `finish_gradient_synchronization()` and `gather_full_params()` ({name: full tensor})."""
    on = (cls, dist.get_rank(), dist.get_world_size(), comm_device())
    return run_check("check_fsdp", [
        Property("equal to one process", lambda: _fsdp_equal(*on),
                 "broadcast rank 0's weights before sharding; pad every weight to a multiple of world_size; "
                 "average (divide by world_size) both the reduce-scattered and the all-reduced gradients"),
        Property("holds shards, frees full weights", lambda: _fsdp_shards(*on),
                 "parameters() must be the shards; drop gathered weights after use (saved-tensor hooks)",
                 needs=("equal to one process",)),
    ], timeout_s, learner_namespaces(cls))
