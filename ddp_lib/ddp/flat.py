"""Lesson 04: flatten every gradient into one buffer, one all-reduce, unflatten."""

from __future__ import annotations

from ddp_lib import comm
from ddp_lib.ddp.base import DDPBase


class FlatDDP(DDPBase):
    """One all-reduce per dtype for the whole model: pays the latency once, copies twice."""

    def _synchronize(self) -> None:
        # flattened per dtype, divided by the world size (under join(): the ranks with data), reduced, copied back
        comm.all_reduce_flat([self._grad_or_zeros(p) for p in self.trainable], self.process_group, self._grad_div,
                             tally=self._tally, label="ddp.allreduce.flat")
