"""Rank-side code of the ZeRO-1 tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.kit.data import shard_batch
from ddp_lib.ddp import FlatDDP
from ddp_lib.kit.models import ToyModel
from ddp_lib.zero import ShardedOptimizer

STEPS = 10


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 32, generator=g), torch.randint(0, 8, (8,), generator=g)


def train(sharded: bool, extra_group: bool = False) -> dict:
    """10 AdamW steps of a DDP-wrapped ToyModel, with the sharded or the plain optimizer."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = ToyModel(depth=3)
    ddp = FlatDDP(model)
    params = list(model.parameters())
    first, rest = (params[:-2], params[-2:]) if extra_group else (params, [])
    kw = dict(lr=1e-2, weight_decay=0.1)
    opt = ShardedOptimizer(first, torch.optim.AdamW, **kw) if sharded else torch.optim.AdamW(first, **kw)
    if rest:
        opt.add_param_group({"params": rest, "lr": 3e-3})
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(ddp(shard_batch(x, rank, ws)), shard_batch(y, rank, ws)).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    out = {"params": [p.detach().clone() for p in model.parameters()]}
    if sharded:
        out["state_bytes"] = opt.state_bytes()
        out["shard_numel"] = opt.shard_numel()
        out["n_state"] = len(opt.state)
    else:
        out["state_bytes"] = sum(t.numel() * t.element_size() for s in opt.state.values()
                                 for t in s.values() if torch.is_tensor(t))
    return out


def both(extra_group: bool) -> dict:
    return {"sharded": train(True, extra_group), "plain": train(False, extra_group)}


def lambda_lr(step: int) -> float:
    return 1.0 / (1 + step)  # a different lr every step: a resumed scheduler must pick up where it was


def resume(split: int | None, steps: int = 6) -> list[torch.Tensor]:
    """AdamW (ZeRO-1) + LambdaLR for `steps` steps; at `split`, save, rebuild everything, load, go on."""
    rank, ws = dist.get_rank(), dist.get_world_size()

    def build(seed: int):
        torch.manual_seed(seed)
        model = ToyModel(depth=3)
        ddp = FlatDDP(model)
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        return model, ddp, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda_lr)

    model, ddp, opt, sched = build(seed=0)
    for step in range(steps):
        if step == split:
            saved = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
            saved = torch.load(_roundtrip(saved), weights_only=False)  # as a checkpoint file would
            model, ddp, opt, sched = build(seed=123)  # different weights, fresh state and schedule
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(ddp(shard_batch(x, rank, ws)), shard_batch(y, rank, ws)).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        sched.step()
    return [p.detach().clone() for p in model.parameters()]


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def resume_both() -> dict:
    return {"straight": resume(split=None), "resumed": resume(split=3)}


def subgroup() -> dict | None:
    """3 ranks; ranks 1 and 2 train in their own group with ZeRO-1 on it, rank 0 stays out."""
    rank = dist.get_rank()
    group = dist.new_group([1, 2])  # every rank must call it
    if rank == 0:
        return None
    out = {}
    for sharded in (True, False):
        torch.manual_seed(0)
        model = ToyModel(depth=3)
        ddp = FlatDDP(model, process_group=group)
        kw = dict(lr=1e-2, weight_decay=0.1)
        opt = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, process_group=group, **kw) if sharded
               else torch.optim.AdamW(model.parameters(), **kw))
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(ddp(shard_batch(x, rank - 1, 2)), shard_batch(y, rank - 1, 2)).backward()
            ddp.finish_gradient_synchronization()
            opt.step()
        out["sharded" if sharded else "plain"] = [p.detach().clone() for p in model.parameters()]
        if sharded:
            out.update(group_rank=opt.rank, group_size=opt.world_size, state_bytes=opt.state_bytes())
        else:
            out["plain_bytes"] = sum(t.numel() * t.element_size() for s in opt.state.values()
                                     for t in s.values() if torch.is_tensor(t))
    return out
