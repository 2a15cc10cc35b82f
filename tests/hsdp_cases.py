"""Rank-side code of tests/test_hsdp.py: the course's HSDP (`FSDP(mesh=2-D)`) on 4 gloo ranks against one process
on the full batch, and beside torch's `fully_shard(mesh=2-D)`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib.bench.fsdp_compare import side_by_side
from ddp_lib.kit.data import shard_batch
from ddp_lib.fsdp import FSDP
from ddp_lib.fsdp.collectives import hsdp_groups, hsdp_mesh, reduce_gradient
from ddp_lib.kit.models import ToyModel

DIM, STEPS, BATCH = 12, 3, 8


def make(seed: int = 0) -> ToyModel:
    torch.manual_seed(seed)
    return ToyModel(DIM, DIM, DIM, depth=2)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, DIM, generator=g), torch.randint(0, DIM, (BATCH,), generator=g)) for _ in range(STEPS)]


def train(model, rank: int, ws: int) -> list[float]:
    """SGD with momentum on this rank's share of each batch; returns each step's full-batch loss (rank mean)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = F.cross_entropy(model(shard_batch(x, rank, ws)), shard_batch(y, rank, ws))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def run(directory: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    mesh = hsdp_mesh(2, ws // 2)
    out: dict = {"groups": [dist.get_process_group_ranks(g) for g in hsdp_groups(mesh)]}

    # 1. the gradient path alone: my chunk of the average over all 4 ranks
    flats = [torch.randn(2 * 6, generator=torch.Generator().manual_seed(r)) for r in range(ws)]
    chunk = reduce_gradient(flats[rank].clone(), *hsdp_groups(mesh))
    want = (sum(flats) / ws).view(2, 6)[mesh.get_local_rank("shard")]
    out["reduce_gradient_diff"] = (chunk - want).abs().max().item()

    # 2. FSDP(mesh=...) against one process on the full batch (every rank computes it itself)
    model = FSDP(make(seed=rank), mesh=mesh)  # each rank its own seed: construction broadcasts rank 0's
    losses = torch.stack(train(model, rank, ws))
    dist.all_reduce(losses)  # equal shares: the mean of the ranks' losses is the full-batch loss
    one = make(seed=0)
    want_losses = torch.stack(train(one, 0, 1))
    full = model.gather_full_params()
    out["one_process"] = {"loss_diff": (losses / ws - want_losses).abs().max().item(),
                          "param_diff": max((full[n] - p).abs().max().item() for n, p in one.named_parameters())}
    out["comm_calls"], out["comm_calls_by_kind"] = model.comm_calls, model.comm_calls_by_kind
    out["units"] = len(set(model.units.values()))
    out["shard_numel"] = model.units[model.module.head].shard.numel()

    # sharded checkpoint: one file per shard rank, written by replica 0, loaded by every replica
    model.save_sharded(directory)
    dist.barrier()
    fresh = FSDP(make(seed=7), mesh=mesh)
    fresh.load_sharded(directory)
    again = fresh.gather_full_params()
    out["sharded_checkpoint"] = {"files": sorted(p.name for p in Path(directory).iterdir()),
                                 "diff": max((again[n] - t).abs().max().item() for n, t in full.items())}

    try:
        FSDP(make(), mesh=mesh, process_group=hsdp_groups(mesh)[0])
        out["both"] = None
    except ValueError as err:
        out["both"] = str(err)

    # 3. beside torch's fully_shard on the same 2-D mesh
    sbs = side_by_side(make, batches(), (nn.Linear,), mesh=mesh)
    out["fully_shard"] = {k: sbs[k] for k in ("ours", "fully_shard", "max_param_diff", "placements")}
    return out
