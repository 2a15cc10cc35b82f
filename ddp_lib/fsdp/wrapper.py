"""Lesson 08: FSDP (ZeRO-3) from scratch: units sharded, gathered just in time, freed, reduce-scattered."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_unflatten

from ddp_lib.comm import broadcast_module_state
from ddp_lib.fsdp.backward import BackwardMixin
from ddp_lib.fsdp.entry import EntryAgreement
from ddp_lib.fsdp.guards import GuardsMixin
from ddp_lib.fsdp.hsdp import hsdp_groups
from ddp_lib.fsdp.state_dict import StateMixin
from ddp_lib.fsdp.units import PendingReduceScatter, Unit, UnitState, plan_units
from ddp_lib.profiling import phase
from ddp_lib.wrapper import DataParallelWrapper


class _GatherUnit(torch.autograd.Function):
    """Forward: the unit's full parameters, all-gathered. Backward: one reduce-scatter of their gradients."""

    @staticmethod
    def forward(ctx, fsdp: "FSDP", u: Unit, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.fsdp, ctx.u = fsdp, u
        return tuple(t.view_as(t) for t in fsdp._wait_gather(u))  # fresh views: one autograd output per use

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.fsdp._reduce_unit(ctx.u, grads)
        return (None, None) + (None,) * len(grads)  # the shards' .grad are filled when the reduce-scatter lands


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done: free the unit then."""

    @staticmethod
    def forward(ctx, fsdp: "FSDP", u: Unit, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.fsdp, ctx.u = fsdp, u
        return tensors

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.fsdp._after_unit_backward(ctx.u)  # frees frozen units too: they have no reduce-scatter
        return (None, None) + grads


class FSDP(BackwardMixin, StateMixin, GuardsMixin, DataParallelWrapper):
    """Fully sharded data parallel: every unit's parameters live as 1/world_size flat shards on each rank.

    Units: by default each `shard_types` module's `weight` (biases and norms replicated, all-reduced as in DDP);
    with `units=(Block,)` each such block holds all its parameters: one all-gather and one reduce-scatter per
    block and pass. Forward gathers a unit when its module starts (prefetching the next) and frees it when it
    ends; autograd saves a note instead of a full weight, and backward gathers again on demand. At most one
    reduce-scatter is in flight (FSDP2's default): its full-size input is dropped once it lands, its output
    folded into the shard's `.grad`. Synchronization finishes at the end of backward (an autograd callback);
    `finish_gradient_synchronization()` only confirms. With `compute_dtype`, shards are fp32 masters, compute
    runs in `compute_dtype` and gradients are reduced in fp32; without it, compute runs in the weights' dtype.
    Inside `no_sync()`, full-size fp32 gradients accumulate per unit on each rank (no reduce-scatter).
    Build the optimizer after wrapping. `debug=True` checks once per step that all ranks gathered alike, and at
    every forward that all ranks are in it (a store round trip; without debug only state_dict & co. agree first).
    The contract (forward, `no_sync`, finish, re-wrap, `comm_calls*`) is `ddp_lib.wrapper`'s, shared with DDP.
    HSDP: `mesh=` a 2-D ("replicate", "shard") DeviceMesh shards within the "shard" dimension and all-reduces each
    reduce-scattered chunk across the "replicate" one (ddp_lib/fsdp/hsdp.py); gradients average over every rank.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 shard_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding),
                 units: tuple[type[nn.Module], ...] | None = None, process_group=None,
                 broadcast_buffers: bool = True, debug: bool = False, mesh: DeviceMesh | None = None):
        super().__init__(module, broadcast_buffers)  # a re-run cell: the old wrapper gives the full weights back
        self.replicate_group, self.sync_group = None, process_group  # sync: init broadcast, replicated grads
        if mesh is not None:  # HSDP: shard along "shard", all-reduce along "replicate", the rest over the world
            if process_group is not None:
                raise ValueError("FSDP: pass mesh= (HSDP) or process_group=, not both")
            process_group, self.replicate_group = hsdp_groups(mesh)
            self.sync_group = None
        self.process_group, self.debug = process_group, debug
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.dp_size = dist.get_world_size(self.sync_group)  # the ranks a gradient averages over
        self.mixed_precision = compute_dtype is not None
        plan = plan_units(module, tuple(shard_types), units)  # every check before the first collective
        self._check_ownership(module, plan)
        broadcast_module_state(module, self.sync_group)  # rank 0's initialisation, then every rank shards the same
        self.units: dict[nn.Module, Unit] = {}  # trigger module -> unit (a tied weight: two modules, one unit)
        by_param: dict[nn.Parameter, tuple[Unit, int]] = {}
        for m, name, pnames in plan:
            params = [(n, m.get_parameter(n)) for n in pnames]
            u = by_param.get(params[0][1], (None,))[0]  # a tied weight: its unit exists already
            if u is None:
                if not self.mixed_precision and len({p.dtype for _, p in params}) > 1:
                    raise ValueError(f"FSDP: unit {name or 'root'} mixes dtypes; pass compute_dtype")
                u = Unit(f"{name}.weight" if pnames == ["weight"] else name or "root", params, self.rank,
                         self.world_size, torch.float32 if self.mixed_precision else None)
                by_param.update((p, (u, i)) for i, (_, p) in enumerate(params))
            self.units[m] = u
            u.bind(m, [(m.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2], i) for i, n in enumerate(pnames)])
        self._install_shards(module, by_param)  # what parameters(), optimizers and state_dict now see
        self.dtype = compute_dtype or next((u.shards[0].dtype for u in self.units.values()), torch.float32)
        self._shard_set = {s for u in self.units.values() for s in u.shards}
        self.replicated = [p for p in module.parameters() if p.requires_grad and p not in self._shard_set]
        self._hooks.extend(h for m in module.modules() if m in self.units or (self.mixed_precision and m._parameters)
                           for h in (m.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                                     m.register_forward_hook(self._post_forward, always_call=True)))
        self.register_grad_hooks(self.replicated)  # their gradients, too, are synchronized when backward ends
        # prefetch plans: units in the order the last forward used them (first guess: module order), and
        # the reverse of the order autograd saved them, which backward follows
        self._fwd_order: list[Unit] = list(dict.fromkeys(self.units.values()))
        self._bwd_order: list[Unit] = []
        self._fwd_seq: list[Unit] = []
        self._packed: list[Unit] = []
        self._unpacked, self._last_unpacked = 0, None
        self._live: dict[int, tuple[Unit, int]] = {}  # storage address of a gathered tensor -> (unit, index)
        self._saved: dict[nn.Module, list[tuple[nn.Module, dict]]] = {}  # parameters to put back after forward
        self._rs: PendingReduceScatter | None = None  # the reduce-scatter in flight (at most one)
        self._start_debug()
        self._register()
        self._entries = EntryAgreement(process_group, self.rank, self.world_size)
        self.entry_timeout_s = 60.0  # how long state_dict() & co. wait for a peer that never calls them

    # ------------------------------------------------------------------ gathering and freeing
    def _start_gather(self, u: Unit) -> None:
        """Launch the async all-gather of `u` (cast first: in bf16 it moves half the bytes)."""
        u.unshard(self.dtype, self.process_group, self._tally)  # SHARDED -> UNSHARDING
        self._note_gather(u)

    def _prefetch(self, order: list[Unit], i: int) -> None:
        """Start gathering `order[i]`, the unit expected next, unless there is none or it is gathered already."""
        if i < len(order) and not order[i].gathered:
            self._start_gather(order[i])

    def _wait_gather(self, u: Unit) -> list[torch.Tensor]:
        """The full parameters of `u`: gathered now unless a prefetch already did, waited for."""
        if u.state is UnitState.SHARDED:
            self._start_gather(u)
        if u.state is UnitState.UNSHARDING:
            with phase(f"ddp.fsdp.wait_gather.{u.name}"):
                u.wait_for_unshard()  # UNSHARDING -> UNSHARDED
            self._live.update((t.untyped_storage().data_ptr(), (u, i)) for i, t in enumerate(u.fulls))
        return u.fulls

    def _free(self, u: Unit) -> None:
        """Reshard `u`: drop its full parameters (a prefetch nobody used lands first)."""
        for t in u.reshard():  # any state -> SHARDED
            self._live.pop(t.untyped_storage().data_ptr(), None)

    def _free_all(self) -> None:
        for u in self.units.values():
            self._free(u)

    # ------------------------------------------------------------------ forward hooks
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        u = self.units.get(module)
        saved = [(module, dict(module._parameters))]
        if self.mixed_precision:  # replicated parameters (norms, biases) join the compute dtype; grads go to fp32
            for name, p in module._parameters.items():
                if p is not None and p.is_floating_point() and p not in self._shard_set:
                    module._parameters[name] = p.to(self.dtype)
        if u is not None:
            self._fwd_seq.append(u)
            if torch.is_grad_enabled():  # first, so that backward runs the gather's node before this one
                flat, spec = tree_flatten((args, kwargs))
                idx = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
                if idx:
                    for i, t in zip(idx, _PostBackward.apply(self, u, *[flat[i] for i in idx])):
                        flat[i] = t
                    args, kwargs = tree_unflatten(flat, spec)
            fulls = _GatherUnit.apply(self, u, *u.shards)
            for sub, pname, i in u.slots[module]:
                if sub is not module:
                    saved.append((sub, dict(sub._parameters)))
                sub._parameters[pname] = fulls[i]  # a plain tensor: setattr would demand a Parameter
            self._prefetch(self._fwd_order, len(self._fwd_seq))  # overlaps this unit's compute
        self._saved[module] = saved
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        for sub, params in reversed(self._saved.pop(module, [])):
            sub._parameters.update(params)
        if module in self.units:
            self._free(self.units[module])

    def _pack(self, t: torch.Tensor) -> Any:
        """Autograd saves a tensor: for a gathered parameter, keep a note of where it lives instead."""
        hit = self._live.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        if hit is None:
            return t
        if not self._packed or self._packed[-1] is not hit[0]:
            self._packed.append(hit[0])
        return hit, t.shape, t.stride(), t.storage_offset()

    def _unpack(self, packed: Any) -> torch.Tensor:
        """Backward needs a saved tensor: its unit is gathered again (or was prefetched), the next prefetched."""
        if isinstance(packed, torch.Tensor):
            return packed
        (u, i), size, stride, offset = packed
        self._queue_end_of_backward()
        full = self._wait_gather(u)[i]
        if u is not self._last_unpacked:
            self._unpacked, self._last_unpacked = self._unpacked + 1, u
            self._prefetch(self._bwd_order, self._unpacked)
        return full.as_strided(size, stride, offset)

    # ------------------------------------------------------------------ the contract's FSDP parts
    _detached_advice = " and build the optimizer on its parameters"

    def _phase_label(self) -> str:
        return "fsdp"

    def _land_in_flight(self) -> None:
        self._land_reduce_scatter()  # left by an interrupted backward
        self._free_all()

    def _run_module(self, args: tuple, kwargs: dict) -> Any:
        """Run the wrapped module with per-unit gathers; floating-point inputs are cast to `compute_dtype`."""
        if self.mixed_precision:
            cast = lambda a: a.to(self.dtype) if torch.is_tensor(a) and a.is_floating_point() else a  # noqa: E731
            args, kwargs = tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}
        self._fwd_seq, self._packed = [], []
        try:
            with phase("ddp.fsdp.forward"), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        except RuntimeError as err:
            self._explain_shard_read(err)
            raise
        finally:
            self._free_all()  # prefetched for a unit that did not run
            # orders every rank saw alike: prefetching issues the same collectives on every rank
            self._fwd_order, self._bwd_order = self._fwd_seq, self._packed[::-1]
            self._unpacked, self._last_unpacked = 0, None
