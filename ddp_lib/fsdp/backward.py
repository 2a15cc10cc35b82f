"""FSDP's gradient path: each unit's reduce-scatter (one in flight), `no_sync`'s local accumulation, HSDP's
all-reduce across replicas, and the replicated parameters' all-reduce when backward ends."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.fsdp.units import PendingReduceScatter, Unit
from ddp_lib.comm import grad_or_zeros


class GradReducer:
    """Reduces FSDP's gradients: reduce-scatter in `group`, all-reduce of each landed chunk across
    `replicate_group` (HSDP), all-reduce of `replicated` over `sync_group`; counted in `tally`."""

    def __init__(self, units: list[Unit], replicated: list[nn.Parameter], group, replicate_group, sync_group,
                 tally: comm.Tally):
        self.units, self.replicated, self.tally = units, replicated, tally
        self.group, self.replicate_group, self.sync_group = group, replicate_group, sync_group
        self.dp_size = dist.get_world_size(sync_group)  # the ranks a gradient averages over (x replicas)
        self.pending: PendingReduceScatter | None = None  # the reduce-scatter in flight (at most one)

    def reduce(self, u: Unit, grads: tuple, local: bool) -> None:
        """The unit's gradients are complete: reduce-scatter them, or (`local`: inside no_sync) keep them."""
        flat = u.reduce_input(grads)  # with what no_sync steps kept
        if local:
            u.keep_local(flat)  # no_sync: full-size fp32 gradients stay on this rank, no communication
        else:
            self.launch(u, flat)

    def launch(self, u: Unit, flat: torch.Tensor) -> None:
        """Launch `u`'s async reduce-scatter of `flat`, after landing the one in flight."""
        self.land()  # one in flight at most: the previous full-size input goes first
        self.pending = u.reduce_scatter(flat, self.group, self.tally)

    def land(self) -> None:
        """Wait for the reduce-scatter in flight, if any, and fold its average into the shards' `.grad`."""
        if self.pending is not None:
            rs, self.pending = self.pending, None  # drops the full-size input as soon as its reduce-scatter is done
            rs.land(self.replicate_group, self.dp_size, self.tally)  # averaged over every rank (x replicas)

    def finish(self) -> None:
        """Backward ended: land the last reduce-scatter, reduce what no_sync kept or nobody used, all-reduce the
        replicated gradients."""
        self.land()
        for u in self.units:
            if (flat := u.take_local()) is not None:  # accumulated under no_sync, unused in this backward
                self.launch(u, flat)
            for s in u.shards:
                if s.requires_grad:
                    grad_or_zeros(s)  # unused in this step: zeros, never a hang
        self.land()
        self._all_reduce_replicated()

    def _all_reduce_replicated(self) -> None:
        # zeros where unused here; replicated on every rank: the world under HSDP
        comm.all_reduce_flat([grad_or_zeros(p) for p in self.replicated], self.sync_group, self.dp_size,
                             tally=self.tally, label="ddp.fsdp.allreduce.replicated")
