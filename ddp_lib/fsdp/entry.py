"""FSDP's entry agreement: the ranks compare which collective call of the wrapper they are in before it runs.

The collective methods of FSDP a user may call on one rank by mistake (`state_dict`, `load_state_dict`,
`gather_full_params`, `clip_grad_norm_`), and with `FSDP(..., debug=True)` every forward too, are numbered on each
rank; before its first collective each rank posts the method's name under that number in the default store and
waits for its peers' posts. The forward stays off this path by default: a store round trip per forward is host
latency FSDP2 does not pay. Different names (rank 0 in `state_dict()`, rank 1 already in the next forward, seen
under debug=True) raise on every rank before any collective runs; a peer that posts nothing within
`entry_timeout_s` (a `state_dict()` called on rank 0 alone) raises on the waiting rank, and a rank that arrives at
an abandoned number later moves on to the next one, so the group stays usable. A forward waits for its peers as
long as the process group would (a rank may legitimately be busy alone for a while); the other methods wait
`entry_timeout_s`. A collective checker's guard already compares every collective: under it this does nothing.
"""

from __future__ import annotations

import time

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddp_lib import comm

# wrappers built so far per group (its global ranks): the same count on every rank of that group
_WRAPPERS: dict[tuple[int, ...], int] = {}

FIX = ("call state_dict() on every rank, save on rank 0: `sd = model.state_dict()` on every rank, then "
       "`if rank == 0: torch.save(sd, path)`")


class EntryMismatch(RuntimeError):
    """The ranks are in different collective methods of one FSDP (or a peer never came)."""


class EntryAgreement:
    """One wrapper's numbered entries in the store (`FSDP._entry(kind)` calls `enter`)."""

    def __init__(self, group, rank: int, world_size: int):
        self.rank = rank
        self.ranks = comm.group_ranks(group)
        self.me = self.ranks[rank]  # this process's global rank (the store's keys use global ranks)
        count = _WRAPPERS[self.ranks] = _WRAPPERS.get(self.ranks, -1) + 1
        self.prefix = f"fsdp-entry/{'-'.join(map(str, self.ranks))}/{count}"
        self.n = 0
        try:
            self.store = c10d._get_default_store() if world_size > 1 else None
        except (RuntimeError, ValueError):
            self.store = None

    def enter(self, kind: str, timeout_s: float) -> None:
        if self.store is None or comm.compared():  # a checker's guard compares every call already
            return
        while True:  # a number a peer abandoned is skipped: its rank has moved on to the next one
            n, self.n = self.n, self.n + 1
            key = f"{self.prefix}/{n}/"
            self.store.set(key + str(self.me), kind)
            if n >= 2:
                self._forget(f"{self.prefix}/{n - 2}/{self.me}")
            peers = [r for r in self.ranks if r != self.me]
            if not self._wait([key + str(r) for r in peers], timeout_s):
                if self.store.compare_set(key + "fate", "", "abandoned") != b"go":
                    late = [r for r in peers if not self.store.check([key + str(r)])]
                    raise EntryMismatch(self._late_message(kind, late, timeout_s)) from None
            if self.store.compare_set(key + "fate", "", "go") != b"go":
                continue  # a peer gave up on this number before this rank came (its call raised): the next one
            theirs = dict(zip(peers, (v.decode() for v in self.store.multi_get([key + str(r) for r in peers]))))
            theirs[self.me] = kind
            if len(set(theirs.values())) > 1:
                raise EntryMismatch(self._mismatch_message(theirs))
            return

    def _wait(self, keys: list[str], timeout_s: float) -> bool:
        """Whether every key appeared within `timeout_s` (polled: a store wait that times out logs a warning)."""
        deadline, pause = time.monotonic() + timeout_s, 0.0
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(0.005, pause + 0.0002)
        return True

    def _forget(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except (RuntimeError, dist.DistError):
            pass

    @staticmethod
    def _mismatch_message(theirs: dict[int, str]) -> str:
        seen = ", ".join(f"rank {r}: {k}()" for r, k in sorted(theirs.items()))
        msg = f"FSDP: the ranks are in different collective calls of one FSDP ({seen}); nothing was sent."
        if "state_dict" in theirs.values():
            msg += (" FSDP's state_dict() gathers every shard (a collective): one rank cannot call it alone, "
                    f"as in `if rank == 0: torch.save(model.state_dict(), path)`. Instead {FIX}")
        else:
            msg += " Call FSDP's methods on every rank, in the same order."
        return msg

    @staticmethod
    def _late_message(kind: str, late: list[int], timeout_s: float) -> str:
        msg = (f"FSDP: rank(s) {late} did not call {kind}() within {timeout_s:g} s; {kind}() is a collective and "
               "runs on every rank or not at all (nothing was sent).")
        if kind == "state_dict":
            msg += f" `if rank == 0: torch.save(model.state_dict(), path)` calls it on rank 0 alone: {FIX}"
        return msg
