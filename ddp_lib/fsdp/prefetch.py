"""FSDP's gathering plan: which unit to gather next, when to let a unit go, and autograd's notes of gathered weights.

Forward gathers the units in the order the last forward used them (first guess: module order), each one prefetched
while its predecessor computes; backward follows the reverse of the order autograd saved them. Autograd keeps a
note (unit, index, view) instead of a gathered weight (`pack`), and backward gathers it again on demand (`unpack`),
so a unit's full parameters live only while it computes (FSDP2's `reshard_after_forward=True`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ddp_lib.fsdp.units import Unit, UnitState
from ddp_lib.comm_records import phase


class Prefetcher:
    """Gathers and frees units for FSDP: `gather(u)` launches a unit's all-gather (FSDP's, counted and labelled),
    `backward_reached(u)` is told when backward has unit `u`'s weight again (gathered, waited for)."""

    def __init__(self, units: list[Unit], gather: Callable[[Unit], None], backward_reached: Callable[[Unit], None]):
        self._units, self._gather, self._backward_reached = units, gather, backward_reached
        self.fwd_order: list[Unit] = list(units)  # the units in the order the last forward used them
        self.bwd_order: list[Unit] = []  # the reverse of the order the last forward's autograd saved them
        self.seq: list[Unit] = []  # the units this forward has entered so far
        self.packed: list[Unit] = []  # the units autograd saved a note of, in order
        self.unpacked, self.last_unpacked = 0, None
        self.live: dict[int, tuple[Unit, int]] = {}  # storage address of a gathered tensor -> (unit, index)

    def wait(self, u: Unit) -> list[torch.Tensor]:
        """The full parameters of `u`: gathered now unless a prefetch already did, waited for."""
        if u.state is UnitState.SHARDED:
            self._gather(u)
        if u.state is UnitState.UNSHARDING:
            with phase(f"ddp.fsdp.wait_gather.{u.name}"):
                u.wait_for_unshard()  # UNSHARDING -> UNSHARDED
            self.live.update((t.untyped_storage().data_ptr(), (u, i)) for i, t in enumerate(u.fulls))
        return u.fulls

    def free(self, u: Unit) -> None:
        """Reshard `u`: drop its full parameters (a prefetch nobody used lands first)."""
        for t in u.reshard():  # any state -> SHARDED
            self.live.pop(t.untyped_storage().data_ptr(), None)

    def free_all(self) -> None:
        """Reshard every unit."""
        for u in self._units:
            self.free(u)

    def _prefetch(self, order: list[Unit], i: int) -> None:
        """Start gathering `order[i]`, the unit expected next, unless there is none or it is gathered already."""
        if i < len(order) and not order[i].gathered:
            self._gather(order[i])

    # ------------------------------------------------------------------ forward
    def begin_forward(self) -> None:
        """A forward starts: record its units and autograd's notes afresh."""
        self.seq, self.packed = [], []

    def entered(self, u: Unit) -> None:
        """Unit `u`'s module starts its forward."""
        self.seq.append(u)

    def prefetch_next(self) -> None:
        """Start gathering the unit the last forward used after the current one: it overlaps this one's compute."""
        self._prefetch(self.fwd_order, len(self.seq))

    def end_forward(self) -> None:
        """The forward ended (or raised): free what a unit that did not run had prefetched; keep the orders this
        forward saw, alike on every rank, so that prefetching issues the same collectives on every rank."""
        self.free_all()
        self.fwd_order, self.bwd_order = self.seq, self.packed[::-1]
        self.unpacked, self.last_unpacked = 0, None

    @property
    def ran(self) -> set[Unit]:
        """The units whose forward started in this forward."""
        return set(self.seq)

    # ------------------------------------------------------------------ autograd's saved tensors
    def pack(self, t: torch.Tensor) -> Any:
        """Autograd saves a tensor: for a gathered parameter, keep a note of where it lives instead."""
        hit = self.live.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        if hit is None:
            return t
        if not self.packed or self.packed[-1] is not hit[0]:
            self.packed.append(hit[0])
        return hit, t.shape, t.stride(), t.storage_offset()

    def unpack(self, packed: Any) -> torch.Tensor:
        """Backward needs a saved tensor: its unit is gathered again (or was prefetched), the next prefetched."""
        if isinstance(packed, torch.Tensor):
            return packed
        (u, i), size, stride, offset = packed
        full = self.wait(u)[i]
        self._backward_reached(u)
        if u is not self.last_unpacked:
            self.unpacked, self.last_unpacked = self.unpacked + 1, u
            self._prefetch(self.bwd_order, self.unpacked)
        return full.as_strided(size, stride, offset)
