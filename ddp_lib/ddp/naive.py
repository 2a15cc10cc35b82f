"""Lesson 04: one blocking all-reduce per gradient, after backward."""

from __future__ import annotations

from ddp_lib.ddp.base import DDPBase


class NaiveDDP(DDPBase):
    """Average each gradient with its own all-reduce once backward is done: simple, latency-bound."""

    def _synchronize(self) -> None:
        for p in self.trainable:
            grad = self._grad_or_zeros(p)
            grad.div_(self._grad_div)  # divide first (by the world size; under join() the ranks with data)
            self._all_reduce(grad)
