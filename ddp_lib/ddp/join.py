"""Lesson 09: `join()`'s part of a DDP engine, for uneven inputs: who still has data, and whose model wins.

Inside `ddp.join()`, every synchronizing forward first all-reduces a "still has data" flag (one extra small
all-reduce per step, as with torch's `Join`). On leaving the block, a rank is out of data: it keeps joining each
step's collectives (buffer broadcast, then the strategy's own all-reduces, in the same order) with zero gradients
until the flag sums to zero. Then every rank takes the parameters and buffers of a rank that ran the most steps
(torch's "last joiner"), since a joined rank skipped those optimizer steps.

The gradient is divided by the number of ranks that still have data, so each step equals single-process training
on the union of those ranks' batches (equal batch sizes); `divide_by_initial_world_size=True` divides by the world
size instead (torch's default), which scales down the steps with fewer ranks. Optimizer state (e.g. momentum) on a
joined rank is not synchronized, as with torch's `Join`. Where torch differs: with `broadcast_buffers` the buffers
still come from rank 0 at every step, even once rank 0 is out of data (torch's join broadcasts them from a rank
that still trains).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.devices import comm_device

__all__ = ["Join"]


class Join:
    """The state of one `join()` block: the divisor rule, and how many steps this rank trained inside it."""

    group = comm.WeakGroup()  # held weakly, as the engine holds it

    def __init__(self, group, world_size: int, divide_by_initial_world_size: bool):
        self.group, self.world_size = group, world_size
        self.divide_by_initial = divide_by_initial_world_size
        self.steps = 0  # synchronizing steps this rank trained inside join()

    def agree(self, still_has_data: bool, will_set_up: bool) -> tuple[int, bool]:
        """All-reduce (this rank still has data, its strategy will run a setup collective at this step); return how
        many ranks still have data and whether any will set up (then every rank must join that collective)."""
        flags = torch.tensor([int(still_has_data), int(will_set_up)], device=comm_device(self.group))
        comm.all_reduce(flags, self.group)
        self.steps += still_has_data
        return int(flags[0].item()), bool(flags[1].item())

    def divisor(self, active: int) -> int:
        """What each gradient is divided by at a step where `active` ranks still have data."""
        return self.world_size if self.divide_by_initial else active

    def take_last_joiners_model(self, module: nn.Module) -> None:
        """Every rank takes the parameters and buffers of the rank that ran the most steps (highest rank on ties)."""
        key = torch.tensor([self.steps * self.world_size + dist.get_rank(self.group)], device=comm_device(self.group))
        comm.all_reduce(key, self.group, op=dist.ReduceOp.MAX)
        src = comm.group_ranks(self.group)[int(key.item()) % self.world_size]
        comm.broadcast_coalesced([p.data for p in module.parameters()] + list(module.buffers()), src, self.group)
