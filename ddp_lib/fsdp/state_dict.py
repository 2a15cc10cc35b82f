"""FSDP's checkpoints and gradient clipping: full and sharded state dicts, `clip_grad_norm_` across ranks."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ddp_lib import comm
from ddp_lib.wrapper import Step

FORMAT = "ddp_lib.fsdp.sharded/1"


def shard_path(directory: str | Path, rank: int, world_size: int) -> Path:
    """The file of `rank` in a sharded checkpoint written by `world_size` ranks."""
    return Path(directory) / f"shard-rank{rank:05d}-of-{world_size:05d}.pt"


class StateMixin:
    """Checkpoints and clipping for FSDP (every method here is a collective unless it says otherwise)."""

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full tensor} for every parameter, named as in the wrapped module (fp32 masters stay fp32)."""
        self._entry("gather_full_params")
        where = {u.shards[i]: (u, i) for u in self.units.values() for i in range(len(u.shards))}
        fulls: dict[Any, list[torch.Tensor]] = {}
        out = {}
        for name, p in self.module.named_parameters():
            if p not in where:
                out[name] = p.detach().clone()
                continue
            u, i = where[p]
            if u not in fulls:
                fulls[u] = u.gather(self.process_group)
            out[name] = fulls[u][i].clone() if len(u.shards) > 1 else fulls[u][i]
        return out

    @contextmanager
    def _materialized(self) -> Iterator[dict]:
        """Inside: the module holds full parameters (original shapes and dtypes) in place of the shards."""
        fulls = {u: [t.to(dt) for t, dt in zip(u.gather(self.process_group), u.dtypes)]
                 for u in dict.fromkeys(self.units.values())}
        try:
            for m, pname, u, i in self._places:
                m._parameters[pname] = fulls[u][i]
            yield fulls
        finally:
            for m, pname, u, i in self._places:
                m._parameters[pname] = u.shards[i]

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """The full model's state dict: the unwrapped module's names and shapes, loadable with strict=True.

        A collective: call it on every rank, save on rank 0 (`sd = model.state_dict()`, then
        `if rank == 0: torch.save(sd, path)`). Called on some ranks only, it raises on every rank that called it
        (after `entry_timeout_s`, or at once when a peer is in another FSDP call) instead of hanging.
        """
        self._entry("state_dict")
        with self._materialized():
            sd = self.module.state_dict(prefix=prefix)
        sd = {k: v.detach().clone() for k, v in sd.items()}  # nothing aliases this rank's live tensors
        if destination is not None:
            destination.update(sd)
            return destination
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
        """Load a full state dict (the same on every rank, e.g. rank 0's file) and re-shard it on every rank."""
        self._entry("load_state_dict")
        with self._materialized() as fulls:
            result = self.module.load_state_dict(state_dict, strict=strict)
            for u, tensors in fulls.items():
                u.load_full(tensors)  # every rank keeps its own chunk of what it loaded
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
        self._entry("clip_grad_norm_")
        if self.step in (Step.ARMED, Step.REDUCED):  # a backward not confirmed yet (finish: once per backward)
            self.finish_gradient_synchronization()
        shards = [s.grad for u in dict.fromkeys(self.units.values()) for s in u.shards if s.grad is not None]
        replicated = [p.grad for p in self.replicated if p.grad is not None]
        dev = self._comm_device()
        mine = replicated if self.rank == 0 else []
        if math.isinf(norm_type):
            local = max([g.detach().abs().max().float() for g in shards + mine], default=torch.zeros((), device=dev))
            total = local.to(dev).reshape(1)
            comm.all_reduce(total, self.process_group, op=dist.ReduceOp.MAX)
        else:
            parts = [g.detach().float().norm(norm_type) ** norm_type for g in shards + mine]
            total = (torch.stack(parts).sum() if parts else torch.zeros((), device=dev)).to(dev).reshape(1)
            comm.all_reduce(total, self.process_group)
            total = total ** (1.0 / norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in shards + replicated:
            g.mul_(coef.to(g.dtype))
        return total[0]
