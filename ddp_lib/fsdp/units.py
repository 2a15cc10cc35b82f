"""FSDP's unit of communication: parameters sharded one by one, gathered and reduce-scattered together."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum, auto

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib import comm
from ddp_lib.fsdp.hsdp import all_reduce_replicas

class UnitState(Enum):
    """Where a unit's parameters are: FSDP2's `ShardedState` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py)
    without SHARDED_POST_FORWARD (resharding to a smaller group after forward), plus the all-gather in flight."""

    SHARDED = auto()  # only this rank's shards exist
    UNSHARDING = auto()  # the all-gather is in flight (`unshard()` ran, `wait_for_unshard()` not yet)
    UNSHARDED = auto()  # the full parameters exist (`fulls`), until `reshard()`


@dataclass
class PendingReduceScatter:
    """A unit's reduce-scatter in flight: its work, its output (this rank's chunk) and its full-size input."""

    work: object
    out: torch.Tensor
    input: torch.Tensor
    unit: "Unit"

    def land(self, replicate_group, dp_size: int, tally: comm.Tally | None = None) -> None:
        """Wait; under HSDP add the replicas' chunks; fold the average over `dp_size` ranks into the shards' .grad."""
        with comm.traced(f"ddp.fsdp.wait_reduce_scatter.{self.unit.name}"):
            self.work.wait()
        if replicate_group is not None:  # HSDP: the replicas holding this chunk add theirs
            all_reduce_replicas(self.out, replicate_group, tally)
        self.unit.fold(self.out, dp_size)


class Unit:
    """Parameters gathered by one all-gather and reduced by one reduce-scatter (FSDP2's `fully_shard` group).

    Each parameter is sharded on its own, as in FSDP2: flattened, zero-padded to a multiple of the world size,
    this rank keeping chunk `rank` as a 1-D Parameter (`.full_shape` holds the original shape). The all-gather
    sends the concatenation of this rank's chunks; rank r's block of the output holds every parameter's chunk r.
    """

    def __init__(self, name: str, params: list[tuple[str, nn.Parameter]], rank: int, world_size: int,
                 master_dtype: torch.dtype | None):
        self.name, self.ws = name, world_size
        self.names = [n for n, _ in params]
        self.shapes = [p.shape for _, p in params]
        self.dtypes = [p.dtype for _, p in params]  # originals, for state dicts
        self.numels = [p.numel() for _, p in params]
        self.sizes = [math.ceil(n / world_size) for n in self.numels]  # per-rank chunk of each parameter
        self.offsets = [sum(self.sizes[:i]) for i in range(len(params))]
        self.size = sum(self.sizes)  # this rank's shard of the whole unit
        self.rank = rank
        self.shards: list[nn.Parameter] = []
        for i, (_, p) in enumerate(params):
            shard = nn.Parameter(self._chunk(i, p.detach()).to(master_dtype or p.dtype).clone(),
                                 requires_grad=p.requires_grad)
            shard.full_shape = p.shape  # 1-D shards hide the shape that `p.dim() >= 2` habits look at
            self.shards.append(shard)
        # the reduce-scatter covers only the parameters that can get a gradient (a frozen base costs nothing)
        self.trainable_idx = [i for i, s in enumerate(self.shards) if s.requires_grad]
        self.trainable_offsets = [sum(self.sizes[j] for j in self.trainable_idx[:k])
                                  for k in range(len(self.trainable_idx))]
        self.trainable_numel = sum(self.sizes[j] for j in self.trainable_idx)
        self.slots: dict[nn.Module, list[tuple[nn.Module, str, int]]] = {}  # trigger module -> where fulls go (bind)
        self.buf: torch.Tensor | None = None  # the all-gather output (kept while gathered for one-parameter units)
        self.work = None  # the all-gather in flight
        self.src: torch.Tensor | None = None  # what the all-gather reads
        self.fulls: list[torch.Tensor] | None = None  # the gathered parameters, original shapes
        self._accum: torch.Tensor | None = None  # no_sync: the unsharded fp32 gradients accumulated locally
        self.state = UnitState.SHARDED

    def _chunk(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of parameter i's full tensor: flattened, zero-padded to ws x its chunk size."""
        size = self.sizes[i]
        return F.pad(full.reshape(-1), (0, size * self.ws - full.numel()))[self.rank * size:(self.rank + 1) * size]

    def bind(self, module: nn.Module, slots: list[tuple[nn.Module, str, int]]) -> None:
        """`module`'s forward uses this unit: each (submodule, name, i) gets full parameter i while it runs."""
        self.slots[module] = slots

    def place(self, module: nn.Module, fulls: list[torch.Tensor]) -> list[tuple[nn.Module, dict]]:
        """Put the full parameters into `module`'s slots for its forward; returns the other submodules' parameter
        dicts as they were, to put back after it (`module`'s own the caller keeps)."""
        saved = []
        for sub, pname, i in self.slots[module]:
            if sub is not module:
                saved.append((sub, dict(sub._parameters)))
            sub._parameters[pname] = fulls[i]  # a plain tensor: setattr would demand a Parameter
        return saved

    @torch.no_grad()
    def load_full(self, tensors: list[torch.Tensor]) -> None:
        """Take full tensors (original shapes) as the new parameters: each shard keeps its own chunk."""
        for i, (s, t) in enumerate(zip(self.shards, tensors)):
            s.copy_(self._chunk(i, t.to(s.dtype)))

    # ------------------------------------------------------------------ lifecycle: SHARDED -> UNSHARDING -> UNSHARDED
    def unshard(self, dtype: torch.dtype, group=None, tally: comm.Tally | None = None) -> None:
        """SHARDED -> UNSHARDING: launch the async all-gather of every rank's chunks (cast first, to `dtype`)."""
        if self.state is not UnitState.SHARDED:
            raise RuntimeError(f"unit {self.name}: unshard() while {self.state.name}; reshard() first")
        self.src = self.gather_input(dtype)
        self.buf = torch.empty(self.size * self.ws, dtype=dtype, device=self.src.device)
        self.work = comm.all_gather_into_tensor(self.buf, self.src, group, async_op=True, tally=tally,
                                                label=f"ddp.fsdp.all_gather.{self.name}")
        self.state = UnitState.UNSHARDING

    @torch.no_grad()
    def gather(self, group=None) -> list[torch.Tensor]:
        """The full parameters in the shards' own dtype (fp32 masters stay fp32), one blocking all-gather, any
        state (for state dicts and giving the module back; the forward path uses unshard)."""
        src = self.gather_input(self.shards[0].dtype)
        buf = torch.empty(self.size * self.ws, dtype=src.dtype, device=src.device)
        comm.all_gather_into_tensor(buf, src, group, label=f"ddp.fsdp.gather.{self.name}")
        return self.unpack(buf)

    def wait_for_unshard(self) -> list[torch.Tensor]:
        """UNSHARDING -> UNSHARDED: wait for the all-gather and unpack; returns the full parameters (any state
        but SHARDED: an UNSHARDED unit returns the ones it holds)."""
        if self.state is UnitState.SHARDED:
            raise RuntimeError(f"unit {self.name}: wait_for_unshard() while SHARDED; unshard() first")
        if self.state is UnitState.UNSHARDING:
            work, self.work = self.work, None
            work.wait()
            self.fulls = self.unpack(self.buf)
            if len(self.shards) > 1:
                self.buf = None  # copied out: the flat output can go
            self.src = None
            self.state = UnitState.UNSHARDED
        return self.fulls

    def reshard(self) -> list[torch.Tensor]:
        """Any state -> SHARDED: an all-gather in flight lands first (never drop a buffer the backend writes);
        the full parameters are dropped. Returns the ones dropped (the caller forgets its notes of them)."""
        if self.work is not None:
            self.work.wait()
        dropped = self.fulls or []
        self.buf = self.work = self.src = self.fulls = None
        self.state = UnitState.SHARDED
        return dropped

    @property
    def shard(self) -> nn.Parameter:
        """The shard of a one-parameter unit (the default: one Linear's or Embedding's weight)."""
        assert len(self.shards) == 1, f"unit {self.name} holds {len(self.shards)} parameters: use .shards"
        return self.shards[0]

    @property
    def gathered(self) -> bool:
        """Whether the full parameters exist (or are being gathered) right now: not SHARDED."""
        return self.state is not UnitState.SHARDED

    def gather_input(self, dtype: torch.dtype) -> torch.Tensor:
        """This rank's chunks, concatenated, in the dtype the all-gather moves."""
        if len(self.shards) == 1:
            return self.shards[0].detach().to(dtype)
        return torch.cat([s.detach().to(dtype) for s in self.shards])

    def unpack(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The full parameters from the all-gather output [ws * size]: views for one parameter, else copies."""
        rows = buf.view(self.ws, self.size)
        return [rows[:, o:o + s].reshape(-1)[:n].view(shape)  # reshape copies a column block (FSDP2's copy-out)
                for o, s, n, shape in zip(self.offsets, self.sizes, self.numels, self.shapes)]

    def grad_input(self, grads: tuple) -> torch.Tensor:
        """The reduce-scatter input [ws * trainable_numel] in fp32: each gradient padded into its column block."""
        dev = self.shards[0].device
        if len(self.trainable_idx) == 1:  # one column block: write straight into the flat buffer, no temporary
            flat = torch.zeros(self.ws * self.trainable_numel, dtype=torch.float32, device=dev)
            g = grads[self.trainable_idx[0]]
            if g is not None:
                flat[:g.numel()] = g.reshape(-1)
            return flat
        flat = torch.zeros(self.ws, self.trainable_numel, dtype=torch.float32, device=dev)
        for j, off in zip(self.trainable_idx, self.trainable_offsets):
            g = grads[j]
            if g is not None:
                s = self.sizes[j]
                flat[:, off:off + s] = F.pad(g.reshape(-1).float(), (0, s * self.ws - g.numel())).view(self.ws, s)
        return flat.view(-1)

    def reduce_input(self, grads: tuple) -> torch.Tensor:
        """The reduce-scatter input of this backward's gradients, plus what no_sync steps kept (taken)."""
        flat = self.grad_input(grads)  # summed in fp32: a bf16 sum over ranks would round every partial sum
        if self._accum is not None:
            flat += self._accum
            self._accum = None
        return flat

    def keep_local(self, flat: torch.Tensor) -> None:
        """no_sync: keep the full-size fp32 gradients on this rank, no communication."""
        self._accum = flat

    def take_local(self) -> torch.Tensor | None:
        """What no_sync kept and no backward since has taken (its unit unused in the synchronizing step), or None."""
        flat, self._accum = self._accum, None
        return flat

    def reduce_scatter(self, flat: torch.Tensor, group=None, tally: comm.Tally | None = None) -> PendingReduceScatter:
        """Launch the async reduce-scatter of `flat` (from reduce_input); land the result with `.land(...)`."""
        out = torch.empty(self.trainable_numel, dtype=torch.float32, device=flat.device)
        work = comm.reduce_scatter_tensor(out, flat, group, async_op=True, tally=tally,
                                          label=f"ddp.fsdp.reduce_scatter.{self.name}")
        return PendingReduceScatter(work, out, flat, self)

    def fold(self, out: torch.Tensor, world_size: int) -> None:
        """Add this rank's reduced chunk [trainable_numel] (summed over ranks) to the shards' `.grad`, averaged."""
        for j, off in zip(self.trainable_idx, self.trainable_offsets):
            g = (out[off:off + self.sizes[j]] / world_size).to(self.shards[j].dtype)
            s = self.shards[j]
            s.grad = g if s.grad is None else s.grad.add_(g)
