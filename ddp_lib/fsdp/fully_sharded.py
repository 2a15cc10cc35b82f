"""Lesson 08: FSDP (ZeRO-3) from scratch: units sharded, gathered just in time, freed, reduce-scattered."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten, tree_unflatten

from ddp_lib import comm
from ddp_lib.comm import broadcast_module_state, grad_or_zeros
from ddp_lib.comm_records import phase
from ddp_lib.contract import DataParallelWrapper, Step
from ddp_lib.fsdp.collectives import fsdp_groups
from ddp_lib.fsdp.guards import Guards
from ddp_lib.fsdp.layout import Layout, plan_units
from ddp_lib.fsdp.state_dict import StateDicts
from ddp_lib.fsdp.unit_group import CommContext, RegisterPostBackward, Schedule, UnitGroup, Unshard


class FSDP(DataParallelWrapper):
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
    The contract (forward, `no_sync`, finish, re-wrap, `comm_calls*`) is `ddp_lib.contract`'s, shared with DDP.
    HSDP: `mesh=` a 2-D ("replicate", "shard") DeviceMesh shards within the "shard" dimension and all-reduces each
    reduce-scattered chunk across the "replicate" one (ddp_lib/fsdp/collectives.py); gradients average over every
    rank. The lifecycle of each unit lives on its `UnitGroup` (ddp_lib/fsdp/unit_group.py); this class holds the
    hooks that call its verbs, a `Layout` (where the shards live), `StateDicts` (checkpoints, clipping) and
    `Guards` (clear errors, the entry agreement).
    """

    UnitGroup, Schedule = UnitGroup, Schedule  # parts a subclass may swap (benchmarks, planted mistakes)

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 shard_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding),
                 units: tuple[type[nn.Module], ...] | None = None, process_group=None,
                 broadcast_buffers: bool = True, debug: bool = False, mesh: DeviceMesh | None = None):
        super().__init__(module, broadcast_buffers, label="fsdp",  # a re-run cell: the old wrapper gives its
                         detached_advice=" and build the optimizer on its parameters")  # full weights back
        self.process_group, replicate_group, self.sync_group = fsdp_groups(process_group, mesh)
        self.rank, self.world_size = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        plan = plan_units(module, tuple(shard_types), units)  # every check before the first collective
        broadcast_module_state(module, self.sync_group)  # rank 0's initialisation, then every rank shards the same
        master = torch.float32 if compute_dtype else None
        self._comm = ctx = CommContext(self.process_group, replicate_group, dist.get_world_size(self.sync_group),
                                       compute_dtype or torch.float32, self._tally, debug)
        self._layout = lay = Layout(module, plan, lambda name, params: self.UnitGroup(
            name, params, ctx, self.rank, self.world_size, master), master)
        ctx.dtype = compute_dtype or next((u.shards[0].dtype for u in lay.unique), torch.float32)
        self._guards = Guards(ctx, lay.device)  # its timeout_s: how long state_dict() & co. wait for a peer
        self._schedule = self.Schedule(lay.unique, ctx)
        self._states = StateDicts(module, lay, ctx)
        self._hook(module)
        self._register()

    # the parts hold these; the wrapper reads them there
    units = property(lambda self: self._layout.units, doc="Trigger module -> unit (a tied weight: two modules, "
                                                           "one unit).")
    dtype = property(lambda self: self._comm.dtype, doc="The compute dtype (the weights' own without compute_dtype).")
    mixed_precision = property(lambda self: self._layout.master_dtype is not None,
                               doc="Whether shards are fp32 masters computed in `compute_dtype`.")
    replicate_group = property(lambda self: self._comm.replicate_group, doc="HSDP's replica group (else None).")
    debug = property(lambda self: self._comm.debug, doc="Whether the costly checks run (guards.py).")

    @property
    def entry_timeout_s(self) -> float:
        """How long state_dict() & co. wait for a peer that never calls them (60 s unless set)."""
        return self._guards.timeout_s

    @entry_timeout_s.setter
    def entry_timeout_s(self, seconds: float) -> None:
        self._guards.timeout_s = seconds

    def _hook(self, module: nn.Module) -> None:
        """Forward hooks on the units' modules (and, with compute_dtype, every module holding parameters); gradient
        hooks on the replicated parameters: their gradients, too, are synchronized when backward ends."""
        self._hooks.extend(h for m in module.modules() if m in self.units or (self.mixed_precision and m._parameters)
                           for h in (m.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
                                     m.register_forward_hook(self._post_forward, always_call=True)))
        self.register_grad_hooks(self._layout.replicated)

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module with per-unit gathers; floating-point inputs are cast to `compute_dtype`."""
        if self.mixed_precision:
            cast = lambda a: a.to(self.dtype) if torch.is_tensor(a) and a.is_floating_point() else a  # noqa: E731
            args, kwargs = tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}
        self._schedule.begin_forward()
        try:
            with phase("ddp.fsdp.forward"), torch.autograd.graph.saved_tensors_hooks(self._schedule.pack,
                                                                                      self._schedule.unpack):
                out = super().forward(*args, **kwargs)  # the contract: refuse, land, broadcast buffers, arm, run
        except RuntimeError as err:
            if self._schedule.seq or self.step is not Step.DETACHED:
                self._guards.explain_shard_read(err, set(self._schedule.seq), self.units)
            raise
        finally:
            self._schedule.end_forward()  # reshards what a unit that did not run had prefetched
        return self._queue_at_backward(out)

    def _before_forward(self) -> None:
        super()._before_forward()  # a detached wrapper says so before anything else runs
        self._guards.check_forward()  # autocast; debug=True: every rank in this forward

    def _queue_at_backward(self, out: Any) -> Any:
        """Backward reaching the output queues the end-of-backward callback (FSDP2's root pre-backward hook)."""
        if torch.is_grad_enabled():
            wrapper = weakref.ref(self)

            def queue(grad: torch.Tensor) -> None:
                if (w := wrapper()) is not None:
                    w._queue_end_of_backward()

            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(queue)
        return out

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        u = self.units.get(module)
        saved = [(module, dict(module._parameters))]
        if self.mixed_precision:  # replicated parameters (norms, biases) join the compute dtype; grads go to fp32
            for name, p in module._parameters.items():
                if p is not None and p.is_floating_point() and p not in self._layout.shard_set:
                    module._parameters[name] = p.to(self.dtype)
        if u is not None:
            if torch.is_grad_enabled():  # first, so that backward runs the gather's node before this one
                flat, spec = tree_flatten((args, kwargs))
                idx = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
                if idx:
                    for i, t in zip(idx, RegisterPostBackward.apply(u, *[flat[i] for i in idx])):
                        flat[i] = t
                    args, kwargs = tree_unflatten(flat, spec)
            saved += self._layout.place(module, Unshard.apply(u, self.step is not Step.LOCAL, *u.shards))
            if (nxt := self._schedule.next_forward(u)) is not None:  # asked once `u` is gathered: not `u`
                nxt.unshard()  # overlaps this unit's compute
        self._layout.saved[module] = saved
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._layout.put_back(module)
        if module in self.units:
            self.units[module].post_forward()

    # ------------------------------------------------------------------ backward's end (the contract's parts)
    def _end_of_backward(self) -> None:
        for u in self._layout.unique:  # after a no_sync backward too
            u.reshard()
        super()._end_of_backward()

    def _synchronize(self) -> None:
        """Land the last reduce-scatter, reduce what no_sync kept, all-reduce the replicated gradients."""
        self._comm.land()
        for u in self._layout.unique:
            u.finalize_backward()
        self._comm.land()
        # zeros where unused here; replicated on every rank: the world under HSDP
        comm.all_reduce_flat([grad_or_zeros(p) for p in self._layout.replicated], self.sync_group,
                             self._comm.dp_size, tally=self._tally, label="ddp.fsdp.allreduce.replicated")
        self._guards.check_same_order()

    def _land_in_flight(self) -> None:
        self._comm.land()  # left by an interrupted backward
        for u in self._layout.unique:
            u.reshard()

    def detach(self) -> None:
        """Give the module back with full parameters (a collective), its hooks removed; the wrapper is done."""
        super().detach()  # in-flight work landed (once), hooks removed
        self._layout.give_back(self.process_group)

    # ------------------------------------------------------------------ collectives a user calls (entry agreed)
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full tensor} for every parameter, named as in the wrapped module (fp32 masters stay fp32)."""
        self._guards.enter("gather_full_params")
        return self._states.gather_full_params()

    def state_dict(self, *, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """The full model's state dict: the unwrapped module's names and shapes, loadable with strict=True.

        A collective: call it on every rank, save on rank 0 (`sd = model.state_dict()`, then
        `if rank == 0: torch.save(sd, path)`). Called on some ranks only, it raises on every rank that called it
        (after `entry_timeout_s`, or at once when a peer is in another FSDP call) instead of hanging.
        """
        self._guards.enter("state_dict")
        sd = self._states.state_dict(prefix, keep_vars)
        return sd if destination is None else destination.update(sd) or destination

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True):
        """Load a full state dict (the same on every rank, e.g. rank 0's file) and re-shard it on every rank."""
        self._guards.enter("load_state_dict")
        return self._states.load_state_dict(state_dict, strict)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the norm of the *full* gradient (one all-reduce); returns that total norm."""
        self._guards.enter("clip_grad_norm_")
        if self.step in (Step.ARMED, Step.REDUCED):  # a backward not confirmed yet (finish: once per backward)
            self.finish_gradient_synchronization()
        return self._states.clip_grad_norm_(max_norm, norm_type)

    def save_sharded(self, directory: str | Path, optimizer: torch.optim.Optimizer | None = None) -> Path:
        """Each rank writes its own shards (and `optimizer`'s state): ddp_lib/fsdp/state_dict.py; no collective."""
        return self._states.save_sharded(directory, optimizer)

    def load_sharded(self, directory: str | Path, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load this rank's file of a sharded checkpoint (ddp_lib/fsdp/state_dict.py); no collective."""
        self._states.load_sharded(directory, optimizer)
