"""Collective helpers the engines, ZeRO-1 and FSDP share: group tensors by kind, broadcast rank 0's state."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def group_by_kind(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split tensors into lists of one dtype and device each (a flat buffer holds only one kind)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def broadcast_coalesced(tensors: list[torch.Tensor], src: int, group=None) -> None:
    """Overwrite `tensors` on every rank with global rank `src`'s, one flat broadcast per dtype/device."""
    for same_kind in group_by_kind(tensors):
        flat = _flatten_dense_tensors(same_kind)
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:
            for t, new in zip(same_kind, _unflatten_dense_tensors(flat, same_kind)):
                t.copy_(new)


def group_rank0(group=None) -> int:
    """The global rank of `group`'s rank 0 (collectives name their source by global rank)."""
    return dist.get_global_rank(group, 0) if group not in (None, dist.group.WORLD) else 0


def broadcast_module_state(module: nn.Module, group=None) -> None:
    """Copy rank 0's parameters (trainable and frozen) and buffers to every rank."""
    broadcast_coalesced([p.data for p in module.parameters()] + list(module.buffers()), group_rank0(group), group)
