"""Lesson 04: flatten every gradient into one buffer, one all-reduce, unflatten."""

from __future__ import annotations

from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lib.comm import group_by_kind
from ddp_lib.ddp.base import DDPBase


class FlatDDP(DDPBase):
    """One all-reduce per dtype for the whole model: pays the latency once, copies twice."""

    def _synchronize(self) -> None:
        for grads in group_by_kind([self._grad_or_zeros(p) for p in self.trainable]):
            flat = _flatten_dense_tensors(grads)
            flat.div_(self._grad_div)  # the world size (under join(): the ranks with data)
            self._all_reduce(flat, label="ddp.allreduce.flat")
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(reduced)
