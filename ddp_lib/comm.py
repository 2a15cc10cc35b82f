"""Collectives: the helpers the engines, ZeRO-1 and FSDP share (group by kind, broadcast rank 0's state), and
lesson 01's ring all-reduce built from point-to-point sends, with a counter of what each rank sends.


The ring: n ranks, the buffer cut into n chunks. Reduce-scatter, n - 1 steps: at step s rank r sends chunk
(r - s) mod n to its right neighbour and adds what its left neighbour sent into chunk (r - s - 1) mod n; afterwards
rank r holds the full sum of chunk (r + 1) mod n. All-gather, n - 1 more steps: pass the summed chunks around the
ring. Each rank sends 2(n - 1) chunks of S/n bytes: 2(n - 1)/n · S, the factor that turns algbw into busbw.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
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

P2P = ("send", "isend")
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
               "all_to_all_single", "gather", "scatter")


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    """Send `send` to `right` and receive into `recv` from `left`, both posted in one group, then wait."""
    # NCCL progresses point-to-point calls that depend on each other only when they sit in one group
    # (ncclGroupStart/End, which batch_isend_irecv issues); an isend followed by a blocking recv can hang there.
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def ring_allreduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` (contiguous) over all ranks, in place, with a ring of batched isend/irecv; returns `x`."""
    n, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    chunks = x.view(-1).tensor_split(n)  # n views, sizes differ by at most one element
    for s in range(n - 1):  # reduce-scatter
        send, recv = chunks[(r - s) % n], chunks[(r - s - 1) % n]
        incoming = torch.empty_like(recv)
        _exchange(send, incoming, right, left)
        recv += incoming
    for s in range(n - 1):  # all-gather
        _exchange(chunks[(r + 1 - s) % n], chunks[(r - s) % n], right, left)
    return x


class Traffic:
    """What the calls made inside `count_traffic()` sent: bytes by point-to-point, and collective calls by name."""

    def __init__(self) -> None:
        self.sent_bytes = 0
        self.sends = 0
        self.collectives: dict[str, int] = {}


@contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count bytes sent with dist.send/isend (batch_isend_irecv included) and every collective called, on this rank.

    Both `torch.distributed` and `torch.distributed.distributed_c10d` get the counting wrappers, so that a
    `P2POp(dist.isend, ...)` built inside the block passes torch's own check of its op and is counted when run.
    """
    seen = Traffic()
    modules = (dist, c10d)
    originals = {name: getattr(c10d, name) for name in P2P + COLLECTIVES if hasattr(c10d, name)}

    def sending(real: Callable) -> Callable:
        def wrapper(tensor, *args, **kwargs):
            seen.sent_bytes += tensor.numel() * tensor.element_size()
            seen.sends += 1
            return real(tensor, *args, **kwargs)
        return wrapper

    def collective(name: str, real: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            seen.collectives[name] = seen.collectives.get(name, 0) + 1
            return real(*args, **kwargs)
        return wrapper

    for name, real in originals.items():
        wrapped = sending(real) if name in P2P else collective(name, real)
        for module in modules:
            setattr(module, name, wrapped)
    try:
        yield seen
    finally:
        for name, real in originals.items():
            for module in modules:
                setattr(module, name, real)


@contextmanager
def spy_on(name: str, on_call: Callable[..., None]) -> Iterator[None]:
    """Inside: each `torch.distributed.<name>(...)` first calls `on_call` with the same arguments, then the real
    collective runs and its result is returned; restored on leaving, also on an error. The tests' and checkers'
    one way to watch what reaches a collective (`count_traffic` counts every collective and send)."""
    real = getattr(dist, name)

    def spy(*args, **kwargs):
        on_call(*args, **kwargs)
        return real(*args, **kwargs)

    setattr(dist, name, spy)
    try:
        yield
    finally:
        setattr(dist, name, real)


def ring_bytes_sent(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `numel` elements: 2(n-1) chunks (exact for numel % n == 0)."""
    return 2 * (world_size - 1) * (numel // world_size) * element_size
