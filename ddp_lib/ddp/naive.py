"""Lesson 04: one blocking all-reduce per gradient, after backward."""

from __future__ import annotations

import torch.nn as nn

from ddp_lib.contract import DataParallelWrapper
from ddp_lib.ddp.strategy import SyncStrategy, grad_or_zeros


class NaiveSync(SyncStrategy):
    """Average each gradient with its own all-reduce once backward is done: simple, latency-bound."""

    def finish(self) -> None:
        for p in self.trainable:
            grad = grad_or_zeros(p)
            grad.div_(self.divide_by)  # divide first (by the world size; under join() the ranks with data)
            self.all_reduce(grad)


class NaiveDDP(DataParallelWrapper):
    """The front (`ddp_lib/contract.py`) driving `NaiveSync`."""

    def __init__(self, module: nn.Module, process_group=None, broadcast_buffers: bool = True):
        super().__init__(module, broadcast_buffers, strategy=NaiveSync, process_group=process_group)
