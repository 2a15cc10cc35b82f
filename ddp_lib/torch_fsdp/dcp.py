"""Distributed checkpoints (DCP) as clusters write them: torch's `fully_shard` model and optimizer, saved sharded by
one world size and loaded by another (torch.distributed.checkpoint reshards on load)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from ddp_lib import comm, compat
from ddp_lib.compat import fsdp2
from ddp_lib.kit.data import shard_batch

DTensor, Shard, _ = compat.dtensor()  # torch.distributed.tensor (2.5+) or ._tensor (2.4)


def sharded_model(make_model: Callable[[], nn.Module], block_types: tuple[type, ...], lr: float = 1e-2):
    """`make_model()` with `fully_shard` on every `block_types` module, then the root, and its AdamW."""
    fully_shard, _ = fsdp2()
    model = make_model()
    mesh = init_device_mesh("cuda" if next(model.parameters()).is_cuda else "cpu", (dist.get_world_size(),))
    for m in [m for m in model.modules() if isinstance(m, block_types)] + [model]:
        fully_shard(m, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
    """SGD-style loop: this rank's share of each global `(x, y)`."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(shard_batch(x, rank, ws)), shard_batch(y, rank, ws)).backward()
        opt.step()


def save(model: nn.Module, opt: torch.optim.Optimizer, directory: str | Path) -> None:
    """Every rank writes its shards of the model and of the optimizer state (a collective; no gather)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory))


def load(model: nn.Module, opt: torch.optim.Optimizer, directory: str | Path) -> None:
    """Every rank reads the pieces its own shards need, whatever world size wrote them (a collective)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def gather_full(p: DTensor) -> torch.Tensor:
    """`p.full_tensor()` for `fully_shard`'s placements (`Shard(0)`, or `(Replicate(), Shard(0))` under HSDP), with
    one all-gather (`comm.all_gather_into_tensor`) in the sharding dimension's group: torch's chunks of ceil(rows / n)
    rows, padded."""
    local = p.to_local().detach()
    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    if not dims:
        return local.clone()
    if len(dims) > 1 or p.placements[dims[0]].dim != 0:
        raise ValueError(f"gather_full: placements {p.placements}; fully_shard's are Shard(0) on one dimension")
    group = p.device_mesh.get_group(dims[0])
    n = dist.get_world_size(group)
    rows = -(-p.shape[0] // n)
    padded = torch.zeros(rows, *p.shape[1:], dtype=local.dtype, device=local.device)
    padded[:local.shape[0]] = local
    buf = torch.empty(n * rows, *p.shape[1:], dtype=local.dtype, device=local.device)
    comm.all_gather_into_tensor(buf, padded, group, label="ddp.dcp.all_gather")
    return buf[:p.shape[0]]


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full tensor} of a `fully_shard` model (each DTensor all-gathered), on the CPU."""
    return {n: gather_full(p).cpu() for n, p in model.named_parameters()}


def reload(directory: str | Path, make_model: Callable[[], nn.Module], block_types: tuple[type, ...]) -> dict:
    """A fresh `fully_shard` model and AdamW on this world size, loaded from `directory`: its full parameters (rank 0's
    result only: `spawn` hands the caller every rank's, and one copy of the model is what it reads) and the AdamW
    step counts it restored (for a group started elsewhere, e.g. 4 ranks reading what 2 wrote)."""
    model, opt = sharded_model(make_model, block_types)
    load(model, opt, directory)
    params = full_params(model)  # a collective: every rank gathers
    return {"params": params if dist.get_rank() == 0 else None,
            "adam_steps": sorted({float(s["step"]) for s in opt.state.values()})}
