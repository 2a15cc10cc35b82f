"""Lesson 04: flatten every gradient into one buffer, one all-reduce, unflatten."""

from __future__ import annotations

import torch.nn as nn

from ddp_lib import comm
from ddp_lib.contract import DataParallelWrapper
from ddp_lib.ddp.strategy import SyncStrategy, grad_or_zeros


class FlatSync(SyncStrategy):
    """One all-reduce per dtype for the whole model: pays the latency once, copies twice."""

    def finish(self) -> None:
        # flattened per dtype, divided by the world size (under join(): the ranks with data), reduced, copied back
        comm.all_reduce_flat([grad_or_zeros(p) for p in self.trainable], self.group, self.divide_by,
                             tally=self.tally, label="ddp.allreduce.flat")


class FlatDDP(DataParallelWrapper):
    """The front (`ddp_lib/contract.py`) driving `FlatSync`."""

    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = True):
        super().__init__(module, broadcast_buffers, strategy=FlatSync, process_group=process_group)
