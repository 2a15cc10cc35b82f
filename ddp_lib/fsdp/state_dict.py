"""FSDP's checkpoints and gradient clipping: full and sharded state dicts, `clip_grad_norm_` across ranks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.fsdp.layout import Layout
from ddp_lib.fsdp.unit_group import CommContext

FORMAT = "ddp_lib.fsdp.sharded/1"


def shard_path(directory: str | Path, rank: int, world_size: int) -> Path:
    """The file of `rank` in a sharded checkpoint written by `world_size` ranks."""
    return Path(directory) / f"shard-rank{rank:05d}-of-{world_size:05d}.pt"


class StateDicts:
    """Checkpoints and clipping of one FSDP's `module` laid out as `layout` over the groups of `ctx` (every method
    here is a collective unless it says otherwise; FSDP's methods of the same names agree on the entry first)."""

    def __init__(self, module: nn.Module, layout: Layout, ctx: CommContext):
        self.module, self.layout, self.ctx = module, layout, ctx
        self.rank, self.world_size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)

    # asked of the context, which holds them weakly: destroy_process_group() frees them while the FSDP lives on
    group = property(lambda self: self.ctx.group, doc="The shard group.")
    replicate_group = property(lambda self: self.ctx.replicate_group, doc="HSDP's replica group (else None).")

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full tensor} for every parameter, named as in the wrapped module (fp32 masters stay fp32)."""
        where = {u.shards[i]: (u, i) for u in self.layout.unique for i in range(len(u.shards))}
        fulls: dict[Any, list[torch.Tensor]] = {}
        out = {}
        for name, p in self.module.named_parameters():
            if p not in where:
                out[name] = p.detach().clone()
                continue
            u, i = where[p]
            if u not in fulls:
                fulls[u] = self.layout.gather(u, self.group)
            out[name] = fulls[u][i].clone() if len(u.shards) > 1 else fulls[u][i]
        return out

    def state_dict(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The full model's state dict: the unwrapped module's names and shapes, copies of no live tensor (with
        `keep_vars`: the replicated Parameters themselves, and the gathered full tensors of the sharded ones)."""
        with self.layout.materialized(self.group):
            sd = self.module.state_dict(prefix=prefix, keep_vars=keep_vars)
        if keep_vars:
            return sd
        return {k: v.detach().clone() for k, v in sd.items()}  # nothing aliases this rank's live tensors

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True):
        """Load a full state dict (the same on every rank) and re-shard it on every rank."""
        with self.layout.materialized(self.group) as fulls:
            result = self.module.load_state_dict(state_dict, strict=strict)
            for u, tensors in fulls.items():
                self.layout.load_full(u, tensors)  # every rank keeps its own chunk of what it loaded
        return result

    def save_sharded(self, directory: str | Path, optimizer: torch.optim.Optimizer | None = None) -> Path:
        """Each rank writes its own shards, replicated parameters and buffers (no gather), and with `optimizer`
        its state (built on this FSDP's parameters: the state of this rank's shards); returns its file. Under HSDP
        the replicas hold the same shards: replica 0 writes, every replica reads."""
        path = shard_path(directory, self.rank, self.world_size)
        if self.replicate_group is not None and dist.get_rank(self.replicate_group) != 0:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": FORMAT, "rank": self.rank, "world_size": self.world_size,
                    "params": {n: p.detach().cpu() for n, p in self.module.named_parameters()},
                    "buffers": {n: b.detach().cpu() for n, b in self.module.named_buffers()},
                    "optimizer": None if optimizer is None else optimizer.state_dict()}, path)
        return path

    @torch.no_grad()
    def load_sharded(self, directory: str | Path, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load this rank's file of a sharded checkpoint (and the optimizer's state into `optimizer`, built on this
        FSDP's parameters); a different world size or layout, or a missing optimizer state, is a clear error."""
        path = shard_path(directory, self.rank, self.world_size)
        if not path.exists():
            written = sorted(p.name for p in Path(directory).glob("shard-rank*-of-*.pt"))
            raise FileNotFoundError(f"no shard for rank {self.rank} of {self.world_size} in {directory} (found "
                                    f"{written[:4]}{'...' if len(written) > 4 else ''}): a sharded checkpoint "
                                    "loads only with the world size that wrote it; use state_dict() to change it")
        data = torch.load(path, map_location="cpu", weights_only=True)
        if data.get("format") != FORMAT or (data["rank"], data["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"{path} holds rank {data.get('rank')} of {data.get('world_size')}, "
                             f"not rank {self.rank} of {self.world_size}")
        for kind, mine in (("params", dict(self.module.named_parameters())),
                           ("buffers", dict(self.module.named_buffers()))):
            theirs = data[kind]
            if set(theirs) != set(mine) or any(theirs[n].shape != mine[n].shape for n in mine):
                raise ValueError(f"{path}: its {kind} do not match this model's (names or shard shapes differ: "
                                 "another model, units or shard_types?)")
            for n, t in mine.items():
                t.copy_(theirs[n])
        if optimizer is not None:
            if data.get("optimizer") is None:
                raise ValueError(f"{path} holds no optimizer state: save it with save_sharded(dir, optimizer)")
            optimizer.load_state_dict(data["optimizer"])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the norm of the *full* gradient (one all-reduce); returns that total norm.

        Shards add their part of the norm on every rank (padding is zero); replicated gradients, equal on every
        rank, are counted on rank 0 only.
        """
        shards = [s.grad for u in self.layout.unique for s in u.shards if s.grad is not None]
        replicated = [p.grad for p in self.layout.replicated if p.grad is not None]
        dev = self.layout.device
        mine = replicated if self.rank == 0 else []
        if math.isinf(norm_type):
            local = max([g.detach().abs().max().float() for g in shards + mine], default=torch.zeros((), device=dev))
            total = local.to(dev).reshape(1)
            comm.all_reduce(total, self.group, op=dist.ReduceOp.MAX)
        else:
            parts = [g.detach().float().norm(norm_type) ** norm_type for g in shards + mine]
            total = (torch.stack(parts).sum() if parts else torch.zeros((), device=dev)).to(dev).reshape(1)
            comm.all_reduce(total, self.group)
            total = total ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in shards + replicated:
            g.mul_(coef.to(g.dtype))
        return total[0]
