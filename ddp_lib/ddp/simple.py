"""Lessons 02-03: the simple DDP class: verify identical replicas, average gradients, accumulate."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib.mesh import require_process_group


class SimpleDistributedDataParallelism:
    """Wraps a model that every rank built identically; `sync_gradients()` averages its gradients."""

    def __init__(self, model: nn.Module):
        require_process_group()
        self.model = model
        self.comm_calls = 0
        self._sync_enabled = True
        self._verify_identical_parameters()

    def _verify_identical_parameters(self) -> None:
        # Compare with rank 0, then agree on the verdict: if only the ranks that differ raised,
        # the others would wait forever in their next collective.
        mismatches = torch.zeros(1)
        for param in self.model.parameters():
            rank0_param = param.data.clone()
            dist.broadcast(rank0_param, src=0)
            if not torch.equal(param.data, rank0_param):
                mismatches += 1
        dist.all_reduce(mismatches)
        if mismatches.item() > 0:
            raise ValueError(
                f"Expected model parameters to be identical on every rank, but {int(mismatches.item())} "
                "differ from rank 0's. Set the same seed on every rank before creating the model."
            )

    @property
    def module(self) -> nn.Module:
        """The wrapped model (the name torch DDP uses)."""
        return self.model

    @property
    def do_sync(self) -> bool:
        """Whether sync_gradients() communicates."""
        return self._sync_enabled

    def enable_grad_sync(self) -> None:
        """Let sync_gradients() average gradients again."""
        self._sync_enabled = True

    def disable_grad_sync(self) -> None:
        """Make sync_gradients() a no-op: gradients accumulate locally."""
        self._sync_enabled = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Disable gradient sync inside the block, restore the previous setting after it."""
        previous = self._sync_enabled
        self.disable_grad_sync()
        try:
            yield
        finally:
            self._sync_enabled = previous

    def sync_gradients(self) -> None:
        """All-reduce every gradient and divide by the world size (nothing while sync is disabled)."""
        if not self.do_sync:
            return
        calls = 0
        for param in self.model.parameters():
            if not param.requires_grad:
                continue
            if param.grad is None:  # no gradient here: still take part, or the others would hang
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad /= dist.get_world_size()
            calls += 1
        self.comm_calls = calls

    def finish_gradient_synchronization(self) -> None:
        """The shared DDP contract's name for sync_gradients()."""
        self.sync_gradients()

    def parameters(self):
        """The wrapped model's parameters, in its order."""
        return self.model.parameters()

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def train(self, mode: bool = True) -> "SimpleDistributedDataParallelism":
        """Put the wrapped model in training mode."""
        self.model.train(mode)
        return self

    def eval(self) -> "SimpleDistributedDataParallelism":
        """Put the wrapped model in evaluation mode."""
        self.model.eval()
        return self
