"""Where FSDP's parameters live: each unit's shards installed in the module's places, the rest replicated; full
parameters put back for a state dict (for a while) or on detach (for good)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn as nn

from ddp_lib.fsdp.collectives import all_gather, concat_chunks
from ddp_lib.fsdp.unit_group import UnitGroup

Plan = list[tuple[nn.Module, str, list[str]]]  # plan_units's answer: (module, its name, its parameters' names)
# modules whose forward reads their children's weights directly (F.multi_head_attention_forward reads
# out_proj.weight without calling out_proj): they are always one unit, so the weights are gathered first
READS_CHILD_WEIGHTS: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def plan_units(module: nn.Module, shard_types: tuple[type[nn.Module], ...],
               unit_types: tuple[type[nn.Module], ...] | None) -> list[tuple[nn.Module, str, list[str]]]:
    """[(module, its name, names of its parameters the unit holds)] in module order; raises for what cannot shard
    (before any collective: a module type that cannot shard, a sharded weight another module also holds).

    With `unit_types` each outermost module of those types is a unit of all its parameters (one collective
    per block); the `shard_types` modules outside them keep one unit per weight (biases replicated).
    """
    big = tuple(unit_types or ()) + READS_CHILD_WEIGHTS
    plan, inside = [], set()
    for name, m in module.named_modules():
        if m in inside:
            continue
        if isinstance(m, big):
            inside.update(m.modules())
            plan.append((m, name, [n for n, p in m.named_parameters() if p.is_floating_point()]))
        elif isinstance(m, shard_types):
            w = m._parameters.get("weight")
            if not isinstance(w, nn.Parameter) or not w.is_floating_point():
                raise ValueError(f"FSDP: {name or 'the module'} ({type(m).__name__}) is in shard_types but has no "
                                 "floating-point `weight` Parameter to shard; leave its type out of shard_types")
            if getattr(m, "sparse", False) or getattr(m, "max_norm", None) is not None:
                raise ValueError(f"FSDP: {name} is an Embedding with sparse=True or max_norm: its weight "
                                 "cannot be sharded (sparse gradients, in-place renormalisation)")
            plan.append((m, name, ["weight"]))
    check_ownership(module, plan)
    return plan


def check_ownership(module: nn.Module, plan: Plan) -> None:
    """A unit's parameter held by a module outside that unit would see a 1-D shard: refuse at construction."""
    allowed: dict[nn.Parameter, set[nn.Module]] = {}
    multi: set[nn.Parameter] = set()
    for m, name, pnames in plan:
        for n in pnames:
            p = m.get_parameter(n)
            if p in allowed and (len(pnames) > 1 or p in multi):
                raise ValueError(f"FSDP: {name}.{n} is shared by two units; put all its users in one unit")
            allowed.setdefault(p, set()).update(m.modules() if len(pnames) > 1 else [m])
            if len(pnames) > 1:
                multi.add(p)
    for name, m in module.named_modules():
        for pname, p in m._parameters.items():
            if p in allowed and m not in allowed[p]:
                raise ValueError(f"FSDP: {f'{name}.{pname}' if name else pname} is a sharded weight that "
                                 f"{type(m).__name__} also holds directly; it would see a shard. Shard both "
                                 "modules or neither (or make the module that holds both a unit)")


class Layout:
    """The units of `module` (built from its plan) with their shards installed where the full parameters were.

    `units`: trigger module -> unit (a tied weight: two modules, one unit); `unique`: each unit once, in module
    order; `replicated`: the trainable parameters no unit holds (biases, norms), all-reduced as in DDP.
    """

    def __init__(self, module: nn.Module, plan: Plan, make: Callable[[str, list], UnitGroup],
                 master_dtype: torch.dtype | None):
        self.units: dict[nn.Module, UnitGroup] = {}
        self.master_dtype = master_dtype  # the shards' dtype under compute_dtype (fp32 masters), else None
        self.saved: dict[nn.Module, list[tuple[nn.Module, dict]]] = {}  # parameter dicts to put back after forward
        self.slots: dict[nn.Module, list[tuple[nn.Module, str, int]]] = {}  # trigger module -> where fulls go
        by_param: dict[nn.Parameter, tuple[UnitGroup, int]] = {}
        for m, name, pnames in plan:
            params = [(n, m.get_parameter(n)) for n in pnames]
            u = by_param.get(params[0][1], (None,))[0]  # a tied weight: its unit exists already
            if u is None:
                if master_dtype is None and len({p.dtype for _, p in params}) > 1:
                    raise ValueError(f"FSDP: unit {name or 'root'} mixes dtypes; pass compute_dtype")
                u = make(f"{name}.weight" if pnames == ["weight"] else name or "root", params)
                by_param.update((p, (u, i)) for i, (_, p) in enumerate(params))
            self.units[m] = u
            self.slots[m] = [(m.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2], i)
                             for i, n in enumerate(pnames)]
        self.unique: list[UnitGroup] = list(dict.fromkeys(self.units.values()))
        self.places = self._install(module, by_param)  # what parameters(), optimizers and state_dict now see
        self.shard_set = {s for u in self.unique for s in u.shards}
        self.replicated = [p for p in module.parameters() if p.requires_grad and p not in self.shard_set]
        self.device = next(iter(self.shard_set)).device if self.shard_set else torch.device("cpu")

    @staticmethod
    def _install(module: nn.Module, index: dict) -> list[tuple[nn.Module, str, UnitGroup, int]]:
        """Put each unit's shards where the full parameters were; return every place, for state dicts."""
        places = []
        for m in module.modules():
            for pname, p in list(m._parameters.items()):
                if p is not None and p in index:
                    u, i = index[p]
                    m._parameters[pname] = u.shards[i]
                    places.append((m, pname, u, i))
        return places

    def place(self, module: nn.Module, fulls: list[torch.Tensor]) -> list[tuple[nn.Module, dict]]:
        """Put a unit's full parameters into `module`'s slots; returns the other submodules' parameter dicts as
        they were, to put back after its forward (`module`'s own the caller keeps)."""
        saved = []
        for sub, pname, i in self.slots[module]:
            if sub is not module:
                saved.append((sub, dict(sub._parameters)))
            sub._parameters[pname] = fulls[i]  # a plain tensor: setattr would demand a Parameter
        return saved

    def put_back(self, module: nn.Module) -> None:
        """`module`'s forward ended: the parameter dicts saved before it are its and its submodules' again."""
        for sub, params in reversed(self.saved.pop(module, [])):
            sub._parameters.update(params)

    @staticmethod
    @torch.no_grad()
    def gather(u: UnitGroup, group=None) -> list[torch.Tensor]:
        """`u`'s full parameters in its shards' own dtype, one blocking all-gather in any state (state dicts,
        detach; a step uses the group's own unshard)."""
        src = concat_chunks(u.shards, u.shards[0].dtype)
        buf, _ = all_gather(src, u.flat.ws, group, None, f"ddp.fsdp.gather.{u.name}", async_op=False)
        return u.flat.unpack(buf)

    @staticmethod
    @torch.no_grad()
    def load_full(u: UnitGroup, tensors: list[torch.Tensor]) -> None:
        """Take full tensors (original shapes) as `u`'s new parameters: each shard keeps its own chunk."""
        for i, (s, t) in enumerate(zip(u.shards, tensors)):
            s.copy_(u.flat.chunk(i, t.to(s.dtype)))

    @contextmanager
    def materialized(self, group=None) -> Iterator[dict[UnitGroup, list[torch.Tensor]]]:
        """Inside: the module holds full parameters (original shapes and dtypes) in place of the shards (a
        collective: one blocking all-gather per unit)."""
        fulls = {u: [t.to(dt) for t, dt in zip(self.gather(u, group), u.dtypes)] for u in self.unique}
        try:
            for m, pname, u, i in self.places:
                m._parameters[pname] = fulls[u][i]
            yield fulls
        finally:
            for m, pname, u, i in self.places:
                m._parameters[pname] = u.shards[i]

    def give_back(self, group=None) -> None:
        """Put full Parameters back into the module for good (detach; a collective)."""
        fulls = {u: self.gather(u, group) for u in self.unique}
        for m, pname, u, i in self.places:
            p = nn.Parameter(fulls[u][i].to(u.dtypes[i]), requires_grad=u.shards[i].requires_grad)
            m._parameters[pname] = fulls[u][i] = p  # tied: the same new Parameter in every place
