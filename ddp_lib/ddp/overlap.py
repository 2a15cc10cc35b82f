"""Lesson 05: start each gradient's all-reduce from a hook the moment backward has produced it."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.contract import DataParallelWrapper
from ddp_lib.ddp.strategy import TWICE, SyncStrategy, grad_or_zeros


class OverlapSync(SyncStrategy):
    """One async all-reduce per gradient, launched during backward and waited for when backward ends.

    Collectives must be issued in the same order on every rank, or rank 0's call for one
    gradient meets rank 1's call for another. So launches follow a fixed order (reverse
    parameter order, the order backward usually produces gradients): a gradient that is ready
    early waits for its predecessors, and one that never comes (an unused parameter) is
    launched, as zeros, when backward ends; then every all-reduce is waited for.
    """

    def __init__(self, module: nn.Module, trainable: list[nn.Parameter], group, tally: comm.Tally,
                 buffers: list[torch.Tensor]):
        super().__init__(module, trainable, group, tally, buffers)
        self.hooked = self.order = list(reversed(trainable))
        self.works: list[dist.Work] = []  # the reductions in flight
        self.ready = [False] * len(self.order)
        self.next = 0  # the next position to launch

    def prepare(self) -> None:
        super().prepare()
        self.ready = [False] * len(self.order)
        self.next = 0

    def on_grad(self, p: nn.Parameter, i: int) -> None:
        if self.ready[i]:
            raise RuntimeError(f"parameter {i} (reverse order) was {TWICE}")
        self.ready[i] = True
        while self.next < len(self.order) and self.ready[self.next]:
            self.launch(self.order[self.next])

    def launch(self, p: nn.Parameter) -> dist.Work:
        grad = grad_or_zeros(p)  # contiguous, as gloo and NCCL need
        grad.div_(self.divide_by)  # the world size (under join(): the ranks with data)
        self.works.append(self.all_reduce(grad, async_op=True, label=f"ddp.allreduce.param{self.next}"))
        self.next += 1
        return self.works[-1]

    def finish(self) -> None:
        while self.next < len(self.order):  # gradients that never arrived: zeros, in order
            self.launch(self.order[self.next])
        self.wait_all(self.works)

    def land(self) -> None:
        if self.works:  # an interrupted backward left some
            self.wait_all(self.works)


class OverlapDDP(DataParallelWrapper):
    """The front (`ddp_lib/contract.py`) driving `OverlapSync`."""

    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = True):
        super().__init__(module, broadcast_buffers, strategy=OverlapSync, process_group=process_group)

    @property
    def order(self) -> list[nn.Parameter]:
        """The parameters in launch order (reverse parameter order)."""
        return self.sync.order
