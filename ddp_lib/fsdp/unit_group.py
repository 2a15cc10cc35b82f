"""FSDP's unit group, shaped like FSDP2's `FSDPParamGroup` (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py):
one object per unit holds its whole lifecycle, with torch's verbs, and the two autograd functions reach it.

    forward   pre_forward  = unshard (unless prefetched) + wait_for_unshard     post_forward  = reshard
    backward  pre_backward = unshard (unless prefetched) + wait_for_unshard     post_backward = reduce-scatter
                                                                                (or keep, inside no_sync) + reshard

`Schedule` says which unit comes next (the order the last forward used, its reverse for backward) and keeps
autograd's notes of gathered weights: autograd saves (unit, index, view) instead of a full weight, and backward's
`unpack` calls the unit's `pre_backward`, so a unit's full parameters live only while it computes.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import Any

import torch
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.fsdp.collectives import FlatLayout, all_gather, all_reduce_replicas, concat_chunks, reduce_scatter

_MOD = (1 << 61) - 1  # a Mersenne prime: the debug order hash stays an exact int64 on every rank


class UnitState(Enum):
    """Where a unit's parameters are: FSDP2's `ShardedState` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py)
    without SHARDED_POST_FORWARD (resharding to a smaller group after forward), plus the all-gather in flight."""

    SHARDED = auto()  # only this rank's shards exist
    UNSHARDING = auto()  # the all-gather is in flight (`unshard()` ran, `wait_for_unshard()` not yet)
    UNSHARDED = auto()  # the full parameters exist, until `reshard()`


class CommContext:
    """What one FSDP's unit groups share: the groups, the gather dtype, the tally, the one reduce-scatter in flight
    (FSDP2's default), the storages of gathered weights and, under debug=True, the hash of this step's gathers. It
    is the one holder of the groups among FSDP's parts (`Guards` and `StateDicts` ask it) and holds them weakly, as
    engines, FSDP included, hold theirs."""

    # weak: destroy_process_group() frees a group and its gloo threads while a notebook's FSDP is still alive
    group, replicate_group = comm.WeakGroup(), comm.WeakGroup()

    def __init__(self, group: Any, replicate_group: Any, dp_size: int, dtype: torch.dtype, tally: comm.Tally,
                 debug: bool = False):
        self.group, self.replicate_group, self.dtype, self.tally = group, replicate_group, dtype, tally
        self.dp_size, self.debug = dp_size, debug  # dp_size: the ranks a gradient averages over (shard x replicas)
        self.in_flight: UnitGroup | None = None
        self.live: dict[int, tuple[UnitGroup, int]] = {}  # storage address -> (unit, index)
        self.order_hash = 0
        self.units = 0  # groups built so far: each group's index, alike on every rank

    def land(self) -> None:
        """Land the reduce-scatter in flight, if any (before the next one launches, and when backward ends)."""
        if self.in_flight is not None:
            unit, self.in_flight = self.in_flight, None
            unit.wait_reduce_scatter()


class UnitGroup:
    """Parameters gathered by one all-gather and reduced by one reduce-scatter (FSDP2's `fully_shard` group).

    Each parameter becomes a 1-D Parameter shard (`.full_shape` holds its shape); `state` says where the full
    parameters are. The group owns its pending reduce-scatter and, inside `no_sync`, its full-size fp32 gradients.
    """

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], ctx: CommContext, rank: int,
                 world_size: int, master_dtype: torch.dtype | None):
        self.name, self.ctx, self.index = name, ctx, ctx.units
        ctx.units += 1
        self.dtypes = [p.dtype for _, p in params]  # originals, for state dicts
        self.flat = FlatLayout([p.shape for _, p in params], rank, world_size)
        self.shards: list[nn.Parameter] = []
        for i, (_, p) in enumerate(params):
            shard = nn.Parameter(self.flat.chunk(i, p.detach()).to(master_dtype or p.dtype).clone(),
                                 requires_grad=p.requires_grad)
            shard.full_shape = p.shape  # 1-D shards hide the shape that `p.dim() >= 2` habits look at
            self.shards.append(shard)
        # the reduce-scatter covers only the parameters that can get a gradient (a frozen base costs nothing)
        self.trainable_idx = [i for i, s in enumerate(self.shards) if s.requires_grad]
        self.state = UnitState.SHARDED
        self._gather: tuple[torch.Tensor, object] | None = None  # (all-gather output, its work) while UNSHARDING
        self.fulls: list[torch.Tensor] | None = None  # the gathered parameters, original shapes
        self._pending: tuple[object, torch.Tensor, torch.Tensor] | None = None  # reduce-scatter: work, out, input
        self._no_sync_grads: torch.Tensor | None = None  # no_sync: the unsharded fp32 gradients kept locally

    # ------------------------------------------------------------------ SHARDED -> UNSHARDING -> UNSHARDED -> SHARDED
    def unshard(self) -> None:
        """SHARDED -> UNSHARDING: launch the async all-gather of every rank's chunks (cast first: bf16 halves it)."""
        if self.state is not UnitState.SHARDED:
            raise RuntimeError(f"unit {self.name}: unshard() while {self.state.name}; reshard() first")
        src = concat_chunks(self.shards, self.ctx.dtype)
        self._gather = all_gather(src, self.flat.ws, self.ctx.group, self.ctx.tally, f"ddp.fsdp.all_gather.{self.name}")
        if self.ctx.debug:  # a polynomial hash of the units gathered since the last check (guards.py compares it)
            self.ctx.order_hash = (self.ctx.order_hash * 1_000_003 + self.index + 1) % _MOD
        self.state = UnitState.UNSHARDING

    def wait_for_unshard(self) -> list[torch.Tensor]:
        """UNSHARDING -> UNSHARDED: wait for the all-gather and unpack; returns the full parameters (an UNSHARDED
        unit returns the ones it holds)."""
        if self.state is UnitState.SHARDED:
            raise RuntimeError(f"unit {self.name}: wait_for_unshard() while SHARDED; unshard() first")
        if self.state is UnitState.UNSHARDING:
            (buf, work), self._gather = self._gather, None
            with comm.phase(f"ddp.fsdp.wait_gather.{self.name}"):
                work.wait()
            self.fulls = self.flat.unpack(buf)  # views of buf for one parameter: it lives as long as they do
            self.ctx.live.update((t.untyped_storage().data_ptr(), (self, i)) for i, t in enumerate(self.fulls))
            self.state = UnitState.UNSHARDED
        return self.fulls

    def reshard(self) -> None:
        """Any state -> SHARDED: an all-gather in flight lands first (never drop a buffer the backend writes);
        the full parameters are dropped, and the notes of them forgotten."""
        if self._gather is not None:
            self._gather[1].wait()
        for t in self.fulls or []:
            self.ctx.live.pop(t.untyped_storage().data_ptr(), None)
        self._gather = self.fulls = None
        self.state = UnitState.SHARDED

    def all_gather_work(self) -> object:
        """The work of the all-gather in flight (UNSHARDING), e.g. to stamp when its data arrives."""
        return self._gather[1]

    # ------------------------------------------------------------------ the hooks' verbs
    def pre_forward(self) -> list[torch.Tensor]:
        """The full parameters for this unit's forward: gathered now unless a prefetch did."""
        if self.state is UnitState.SHARDED:
            self.unshard()
        return self.wait_for_unshard()

    def post_forward(self) -> None:
        """The forward is done: only the shards stay (FSDP2's reshard_after_forward=True)."""
        self.reshard()

    def pre_backward(self) -> list[torch.Tensor]:
        """Backward needs a saved weight again: gathered again, unless prefetched."""
        return self.pre_forward()

    def post_backward(self, grads: tuple, sync: bool) -> None:
        """The unit's gradients are complete: reduce-scatter them (`sync`) or keep them (no_sync); reshard."""
        flat = self.flat.grad_input(grads, self.trainable_idx, self.shards[0].device)  # summed in fp32
        if self._no_sync_grads is not None:
            flat += self._no_sync_grads
            self._no_sync_grads = None
        if sync:
            self.reduce_scatter(flat)
        else:
            self._no_sync_grads = flat  # full-size fp32 gradients stay on this rank, no communication
        self.reshard()

    def reduce_scatter(self, flat: torch.Tensor) -> None:
        """Launch the async reduce-scatter of `flat`, after landing the one in flight (one at most)."""
        self.ctx.land()
        out, work = reduce_scatter(flat, self.flat.ws, self.ctx.group, self.ctx.tally,
                                   f"ddp.fsdp.reduce_scatter.{self.name}")
        self._pending, self.ctx.in_flight = (work, out, flat), self
        # the full-size input is held until the work lands: the backend reads it meanwhile

    def wait_reduce_scatter(self) -> None:
        """Wait; under HSDP add the replicas' chunks; fold the average over every rank into the shards' `.grad`."""
        (work, out, _), self._pending = self._pending, None  # the full-size input goes now
        with comm.traced(f"ddp.fsdp.wait_reduce_scatter.{self.name}"):
            work.wait()
        if self.ctx.replicate_group is not None:
            all_reduce_replicas(out, self.ctx.replicate_group, self.ctx.tally)
        for j, chunk in zip(self.trainable_idx, self.flat.chunks_of(out, self.trainable_idx)):
            s, g = self.shards[j], (chunk / self.ctx.dp_size).to(self.shards[j].dtype)
            s.grad = g if s.grad is None else s.grad.add_(g)

    def finalize_backward(self) -> None:
        """Backward ended: reduce what no_sync kept and no backward since used; zeros for an unused shard."""
        if self._no_sync_grads is not None:
            flat, self._no_sync_grads = self._no_sync_grads, None
            self.reduce_scatter(flat)
        for j in self.trainable_idx:
            if self.shards[j].grad is None:  # unused in this step: zeros, never a hang
                self.shards[j].grad = torch.zeros_like(self.shards[j])

    @property
    def shard(self) -> nn.Parameter:
        """The shard of a one-parameter unit (the default: one Linear's or Embedding's weight)."""
        assert len(self.shards) == 1, f"unit {self.name} holds {len(self.shards)} parameters: use .shards"
        return self.shards[0]

    @property
    def gathered(self) -> bool:
        """Whether the full parameters exist (or are being gathered) right now: not SHARDED."""
        return self.state is not UnitState.SHARDED


class Unshard(torch.autograd.Function):
    """Forward: the group's pre_forward (its full parameters). Backward: the group's post_backward."""

    @staticmethod
    def forward(ctx, group: UnitGroup, sync: bool, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.sync = group, sync  # sync: captured by the forward, as no_sync() decides
        return tuple(t.view_as(t) for t in group.pre_forward())  # fresh views: one autograd output per use

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.group.post_backward(grads, ctx.sync)
        return (None, None) + (None,) * len(grads)  # the shards' .grad are filled when the reduce-scatter lands


class RegisterPostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done: reshard the unit then (a
    frozen unit has no reduce-scatter to do it). torch's name, in _fully_shard/_fsdp_param_group.py."""

    @staticmethod
    def forward(ctx, group: UnitGroup, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.group.reshard()
        return (None,) + grads


class Schedule:
    """Which unit to gather next, and autograd's notes of gathered weights. Forward gathers the units in the order
    the last forward used them (first guess: module order); backward in the reverse of the order autograd saved
    them; each prefetched while its predecessor computes. The order is the same on every rank, and so are the
    all-gathers, matched by call order."""

    def __init__(self, groups: list[UnitGroup], ctx: CommContext):
        self.groups, self.ctx = groups, ctx
        self.fwd_order: list[UnitGroup] = list(groups)  # the units in the order the last forward used them
        self.bwd_order: list[UnitGroup] = []  # the reverse of the order the last forward's autograd saved them
        self.seq: list[UnitGroup] = []  # the units this forward has entered so far
        self.packed: list[UnitGroup] = []  # the units autograd saved a note of, in order
        self.unpacked, self.last_unpacked = 0, None

    def begin_forward(self) -> None:
        """A forward starts: record its units and autograd's notes afresh."""
        self.seq, self.packed = [], []

    def next_forward(self, u: UnitGroup) -> UnitGroup | None:
        """`u`'s forward starts: the unit expected after it, if not gathered yet (to prefetch), else None."""
        self.seq.append(u)
        return self._next(self.fwd_order, len(self.seq))

    def end_forward(self) -> None:
        """The forward ended (or raised): reshard what a unit that did not run had prefetched; keep the orders."""
        for g in self.groups:
            g.reshard()
        self.fwd_order, self.bwd_order = self.seq, self.packed[::-1]
        self.unpacked, self.last_unpacked = 0, None

    def next_backward(self, u: UnitGroup) -> UnitGroup | None:
        """Backward reached `u`: the unit expected after it, if not gathered yet (to prefetch), else None."""
        if u is self.last_unpacked:
            return None
        self.unpacked, self.last_unpacked = self.unpacked + 1, u
        return self._next(self.bwd_order, self.unpacked)

    @staticmethod
    def _next(order: list[UnitGroup], i: int) -> UnitGroup | None:
        return order[i] if i < len(order) and not order[i].gathered else None

    def pack(self, t: torch.Tensor) -> Any:
        """Autograd saves a tensor: for a gathered parameter, keep a note of where it lives instead."""
        hit = self.ctx.live.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        if hit is None:
            return t
        if not self.packed or self.packed[-1] is not hit[0]:
            self.packed.append(hit[0])
        return hit, t.shape, t.stride(), t.storage_offset()

    def unpack(self, note: Any) -> torch.Tensor:
        """Backward needs a saved tensor: its unit's pre_backward gathers it again; the next unit is prefetched."""
        if isinstance(note, torch.Tensor):
            return note
        (u, i), size, stride, offset = note
        full = u.pre_backward()[i]
        if (nxt := self.next_backward(u)) is not None:
            nxt.unshard()
        return full.as_strided(size, stride, offset)
