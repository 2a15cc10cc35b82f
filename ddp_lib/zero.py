"""Lesson 07: ZeRO stage 1, each rank keeps the optimizer state of its own shard of the parameters."""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ddp_lib.comm import WeakGroup, broadcast_coalesced, is_world
from ddp_lib.devices import require_process_group
from ddp_lib.comm_records import phase


class ShardedOptimizer(torch.optim.Optimizer):
    """Wraps `optimizer_cls` so each rank steps (and stores state for) only its shard, then shares the result.

    Shards are balanced by parameter size (largest first, onto the least loaded rank), decided
    from shapes alone so every rank computes the same assignment. Gradients must already be
    averaged across ranks (a DDP wrapper does that); after `step()` every rank holds every
    updated parameter again, broadcast by the rank that owns it. `process_group` (default: the
    world) gives the ranks that share the state: its rank, its size and every collective.
    """

    process_group = WeakGroup()  # held weakly: destroy_process_group() frees it (ddp_lib.comm.WeakGroup)

    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], process_group=None,
                 **kwargs: Any):
        require_process_group()
        self.process_group = process_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        whole_world = is_world(process_group)
        # collectives name their source by global rank
        self._global_rank = [r if whole_world else dist.get_global_rank(process_group, r)
                             for r in range(self.world_size)]
        self.owner: dict[torch.nn.Parameter, int] = {}
        self._load = [0] * self.world_size  # elements owned per rank
        self.optim: torch.optim.Optimizer | None = None
        self._local_groups: list[dict] = []
        super().__init__(params, defaults=kwargs)  # calls add_param_group for each group
        self.optim = optimizer_cls(self._local_groups, **kwargs)
        self.state = self.optim.state  # this rank's shard of the state, nothing else

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapper and this rank's share of it to the local optimizer."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        new = sorted(group["params"], key=lambda p: -p.numel())  # stable: ties keep their order
        for p in new:
            r = min(range(self.world_size), key=lambda i: (self._load[i], i))
            self.owner[p] = r
            self._load[r] += p.numel()
        local = {**_hyper(group), "params": [p for p in group["params"] if self.owner[p] == self.rank]}
        self._local_groups.append(local)
        if self.optim is not None:  # a group added after construction
            self.optim.add_param_group(local)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Step this rank's shard, then broadcast every shard from its owner."""
        for group, local in zip(self.param_groups, self.optim.param_groups):
            local.update(_hyper(group))  # the wrapper's groups are the truth, e.g. an LR scheduler's lr
        loss = self.optim.step(closure)
        with phase("zero1.broadcast"):
            for src in range(self.world_size):
                owned = [p.data for g in self.param_groups for p in g["params"] if self.owner[p] == src]
                broadcast_coalesced(owned, self._global_rank[src], self.process_group)
        return loss

    def shard_numel(self, rank: int | None = None) -> int:
        """Parameters (elements) whose state `rank` (default: this rank) keeps."""
        return self._load[self.rank if rank is None else rank]

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank."""
        return sum(t.numel() * t.element_size() for s in self.optim.state.values()
                   for t in s.values() if torch.is_tensor(t))

    def state_dict(self) -> dict[str, Any]:
        """The hyper-parameters of every group and this rank's shard of the state (each rank saves its own)."""
        return {"param_groups": [copy.deepcopy(_hyper(g)) for g in self.param_groups],
                "shard": self.optim.state_dict(), "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what this rank's state_dict() saved, into an optimizer built the same way."""
        where = (state_dict["rank"], state_dict["world_size"])
        if where != (self.rank, self.world_size) or len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError(f"this shard was saved by rank {where[0]} of {where[1]} with "
                             f"{len(state_dict['param_groups'])} param groups; this is rank {self.rank} of "
                             f"{self.world_size} with {len(self.param_groups)}: load each rank's own file")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(copy.deepcopy(saved))
        self.optim.load_state_dict(state_dict["shard"])
        self.state = self.optim.state  # load_state_dict replaced the inner optimizer's state dict


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    """A param group without its parameters: lr, betas, weight_decay, ..."""
    return {k: v for k, v in group.items() if k != "params"}
