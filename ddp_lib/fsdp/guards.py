"""FSDP's guards: checks that turn silent corruption into clear errors (autocast, a parent reading a child's shard,
ranks gathering differently under debug=True) and the entry agreement of the collective methods (entry.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.fsdp.entry import EntryAgreement
from ddp_lib.fsdp.unit_group import CommContext, UnitGroup


class Guards:
    """FSDP's checks over its `CommContext` (group, debug order hash) and the `device` its collectives use; `debug=True` adds the costly
    ones (every rank in each forward, every rank gathering alike in each step)."""

    def __init__(self, ctx: CommContext, device: torch.device):
        self.ctx, self.device, self.debug = ctx, device, ctx.debug
        self._entries = EntryAgreement(self.group, dist.get_rank(self.group), dist.get_world_size(self.group))
        self.timeout_s = 60.0  # how long an entry waits for a peer that never calls the same method

    group = property(lambda self: self.ctx.group, doc="The shard group, asked of the context (which holds it weakly).")

    def enter(self, kind: str, timeout_s: float | None = None) -> None:
        """Agree with every rank that the collective method `kind` is the one they are all in, or raise."""
        self._entries.enter(kind, self.timeout_s if timeout_s is None else timeout_s)

    @property
    def entered(self) -> int:
        """How many entry agreements this wrapper has made (each a few store round trips)."""
        return self._entries.n

    def check_forward(self) -> None:
        """Before a forward: not under autocast; with debug=True, every rank in this forward (or raise)."""
        if torch.is_autocast_enabled(self.device.type):
            raise RuntimeError("FSDP under torch.autocast: autograd would save autocast's copies of the gathered "
                               "weights and keep them all alive. Use FSDP(module, compute_dtype=torch.bfloat16) "
                               "and no autocast around the FSDP forward")
        if self.debug:  # store round trips at every forward: only when asked (FSDP2 pays none)
            store = self._entries.store  # a forward waits as long as the process group would
            self.enter("forward", store.timeout.total_seconds() if store is not None else self.timeout_s)

    @staticmethod
    def explain_shard_read(err: RuntimeError, ran: set[UnitGroup], units: dict[nn.Module, UnitGroup]) -> None:
        """A forward failed: if some unit never ran, a parent may have read its 1-D shard directly; say so."""
        idle = [f"{type(m).__name__} {u.name}" for m, u in units.items() if u not in ran]
        if idle and hasattr(err, "add_note"):
            err.add_note(f"FSDP: units whose forward did not run before this error: {', '.join(idle[:4])}. A module "
                         "that reads a child's weight directly (as nn.MultiheadAttention reads out_proj.weight) "
                         "sees a flat 1-D shard: make that module one unit, FSDP(model, units=(ItsType,))")

    # ------------------------------------------------------------------ debug: every rank gathers alike
    def check_same_order(self) -> None:
        """debug=True: one all-reduce per step; raise on every rank if the ranks' gather sequences differ."""
        if not self.debug:
            return
        h = torch.tensor([self.ctx.order_hash, -self.ctx.order_hash], dtype=torch.int64, device=self.device)
        mine = h.clone()
        comm.all_reduce(h, self.group, op=dist.ReduceOp.MAX)
        self.ctx.order_hash = 0  # the hash of the gathers since the last check (UnitGroup.unshard adds to it)
        if not torch.equal(h, mine):
            raise RuntimeError("FSDP debug: the ranks gathered different units or in a different order in this "
                               "step (control flow that depends on the rank or its data?); all-gathers are "
                               "matched by call order, so same-sized units would silently swap shards")
