"""Rank-side code of the ZeRO-1 tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.data import shard_batch
from ddp_lib.ddp import FlatDDP
from ddp_lib.models import ToyModel
from ddp_lib.optim import ShardedOptimizer

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
