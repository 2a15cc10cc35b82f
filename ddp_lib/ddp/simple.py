"""Lessons 02-03: the simple DDP class: verify identical replicas, average gradients, accumulate."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.devices import comm_device, require_process_group
from ddp_lib.comm import grad_or_zeros


def verify_identical_parameters(model: nn.Module) -> None:
    """Raise ValueError on every rank when any parameter differs from rank 0's (bit for bit)."""
    # O(1) collectives, however many parameters: all their bytes in one flat buffer on the
    # communication device (nccl cannot reduce a CPU tensor), one broadcast of rank 0's buffer,
    # a bitwise comparison, then one all-reduce so that every rank reaches the same verdict:
    # if only the ranks that differ raised, the others would wait forever in their next collective.
    device = comm_device()
    params = [p.detach() for p in model.parameters()]
    nbytes = [p.numel() * p.element_size() for p in params]
    mine = torch.empty(sum(nbytes), dtype=torch.uint8, device=device)
    for chunk, p in zip(mine.split(nbytes), params):
        chunk.copy_(p.reshape(-1).view(torch.uint8))
    rank0 = mine.clone()
    comm.broadcast(rank0, src=0)
    differ = mine.ne_(rank0)  # in place: 1 where a byte differs from rank 0's
    mismatches = torch.zeros(1, dtype=torch.int64, device=device)
    for chunk in differ.split(nbytes):
        mismatches += chunk.any()  # parameters, not bytes, that differ on this rank
    comm.all_reduce(mismatches)
    if (n := int(mismatches.item())) > 0:
        raise ValueError(
            f"Expected model parameters to be identical on every rank, but {n} differ from rank 0's. "
            "Set the same seed on every rank before creating the model."
        )


def average_gradients(model: nn.Module) -> int:
    """Replace every trainable parameter's .grad by its average over ranks; return the all-reduce calls."""
    calls = 0
    for param in model.parameters():
        if not param.requires_grad:  # read at every call: freezing a parameter later is followed
            continue
        grad = grad_or_zeros(param)  # zeros if none here (still take part, or the others hang); contiguous
        comm.all_reduce(grad, op=dist.ReduceOp.SUM)
        param.grad /= dist.get_world_size()
        calls += 1
    return calls


class SimpleDistributedDataParallelism:
    """Wraps a model that every rank built identically; `sync_gradients()` averages its gradients."""

    def __init__(self, model: nn.Module):
        require_process_group()
        self.model = model
        self.comm_calls = 0
        self._sync_enabled = True
        verify_identical_parameters(model)

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
        """Average every gradient over ranks (nothing while sync is disabled)."""
        if self.do_sync:
            self.comm_calls = average_gradients(self.model)

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
