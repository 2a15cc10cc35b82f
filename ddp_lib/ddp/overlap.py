"""Lesson 05: start each gradient's all-reduce from a hook the moment backward has produced it."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.ddp.base import TWICE, DDPBase


class OverlapDDP(DDPBase):
    """One async all-reduce per gradient, launched during backward and waited for when backward ends.

    Collectives must be issued in the same order on every rank, or rank 0's call for one
    gradient meets rank 1's call for another. So launches follow a fixed order (reverse
    parameter order, the order backward usually produces gradients): a gradient that is ready
    early waits for its predecessors, and one that never comes (an unused parameter) is
    launched, as zeros, when backward ends; then every all-reduce is waited for.
    """

    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = True):
        super().__init__(module, process_group, broadcast_buffers)
        self.order = list(reversed(self.trainable))
        self._ready = [False] * len(self.order)
        self._next = 0  # the next position to launch
        self.register_grad_hooks(self.order)

    def _prepare_sync(self) -> None:
        self._ready = [False] * len(self.order)
        self._next = 0

    def _on_grad_ready(self, p: nn.Parameter, i: int) -> None:
        if self._ready[i]:
            raise RuntimeError(f"parameter {i} (reverse order) was {TWICE}")
        self._ready[i] = True
        while self._next < len(self.order) and self._ready[self._next]:
            self._launch(self.order[self._next])

    def _launch(self, p: nn.Parameter) -> dist.Work:
        grad = self._grad_or_zeros(p)  # contiguous, as gloo and NCCL need
        grad.div_(self._grad_div)  # the world size (under join(): the ranks with data)
        self._works.append(self._all_reduce(grad, async_op=True, label=f"ddp.allreduce.param{self._next}"))
        self._next += 1
        return self._works[-1]

    def _synchronize(self) -> None:
        while self._next < len(self.order):  # gradients that never arrived: zeros, in order
            self._launch(self.order[self._next])
        comm.wait_all(self._works)
