"""FSDP's hardening: ownership and autocast checks, giving the full weights back on detach, the debug check that
every rank gathered alike (re-wrapping itself is `ddp_lib.wrapper`'s)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm

_MOD = (1 << 61) - 1  # a Mersenne prime: the order hash stays an exact int64 on every rank


class GuardsMixin:
    """Checks that turn silent corruption into clear errors; mixed into FSDP."""

    def _start_debug(self) -> None:
        self._unit_ids = {u: k for k, u in enumerate(dict.fromkeys(self.units.values()))}
        self._order_hash = 0
        self._device_type = self._comm_device().type

    def _check_ownership(self, module: nn.Module, plan: list) -> None:
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

    def _install_shards(self, module: nn.Module, index: dict) -> None:
        """Put each unit's shards where the full parameters were; remember every place for state dicts."""
        self._places: list[tuple[nn.Module, str, object, int]] = []
        for m in module.modules():
            for pname, p in list(m._parameters.items()):
                if p is not None and p in index:
                    u, i = index[p]
                    m._parameters[pname] = u.shards[i]
                    self._places.append((m, pname, u, i))

    def _check_usable(self) -> None:
        """Before a forward: not detached, not under autocast; with debug=True, every rank in this forward (or raise)."""
        super()._check_usable()
        if torch.is_autocast_enabled(self._device_type):
            raise RuntimeError("FSDP under torch.autocast: autograd would save autocast's copies of the gathered "
                               "weights and keep them all alive. Use FSDP(module, compute_dtype=torch.bfloat16) "
                               "and no autocast around the FSDP forward")
        if self.debug:  # a store round trip per forward: only when asked (FSDP2 pays none)
            self._entry("forward")  # every rank is in this forward, not one of them in state_dict(): or raise

    def _explain_shard_read(self, err: RuntimeError) -> None:
        """A forward failed: if some unit never ran, a parent may have read its 1-D shard directly; say so."""
        ran = set(self._fwd_seq)
        idle = [f"{type(m).__name__} {u.name}" for m, u in self.units.items() if u not in ran]
        if idle and hasattr(err, "add_note"):
            err.add_note(f"FSDP: units whose forward did not run before this error: {', '.join(idle[:4])}. A module "
                         "that reads a child's weight directly (as nn.MultiheadAttention reads out_proj.weight) "
                         "sees a flat 1-D shard: make that module one unit, FSDP(model, units=(ItsType,))")

    def _release(self) -> None:
        """On detach: put full parameters back into the module (a collective); the base then removes every hook."""
        self._land_in_flight()
        fulls = {u: u.gather(self.process_group) for u in dict.fromkeys(self.units.values())}
        for m, pname, u, i in self._places:
            p = nn.Parameter(fulls[u][i].to(u.dtypes[i]), requires_grad=u.shards[i].requires_grad)
            m._parameters[pname] = fulls[u][i] = p  # tied: the same new Parameter in every place

    # ------------------------------------------------------------------ debug: every rank gathers alike
    def _note_gather(self, u) -> None:
        if self.debug:  # a polynomial hash of the sequence of unit ids gathered since the last check
            self._order_hash = (self._order_hash * 1_000_003 + self._unit_ids[u] + 1) % _MOD

    def _check_same_order(self) -> None:
        """debug=True: one all-reduce per step; raise on every rank if the ranks' gather sequences differ."""
        if not self.debug:
            return
        h = torch.tensor([self._order_hash, -self._order_hash], dtype=torch.int64, device=self._comm_device())
        mine = h.clone()
        comm.all_reduce(h, self.process_group, op=dist.ReduceOp.MAX)
        self._order_hash = 0
        if not torch.equal(h, mine):
            raise RuntimeError("FSDP debug: the ranks gathered different units or in a different order in this "
                               "step (control flow that depends on the rank or its data?); all-gathers are "
                               "matched by call order, so same-sized units would silently swap shards")

    def _entry(self, kind: str) -> None:
        """Agree with every rank that this collective method is the one they are all in (ddp_lib/fsdp/entry.py)."""
        store = self._entries.store
        wait = store.timeout.total_seconds() if kind == "forward" and store is not None else self.entry_timeout_s
        self._entries.enter(kind, wait)

    def _comm_device(self) -> torch.device:
        return next(iter(self._shard_set)).device if self._shard_set else torch.device("cpu")

