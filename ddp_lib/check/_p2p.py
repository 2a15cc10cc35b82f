"""Point-to-point calls under the guard: send/recv (and isend/irecv) on a side group with the check's timeout.

A learner's ring all-reduce can hang (both ranks receive first, a receive with no sender) or post sizes
that differ (gloo aborts the process). So, inside a property that asks for it (`Property(..., p2p=True)`):
- p2p calls on the default group go to a fresh gloo group whose timeout is the check's limit: whatever
  slips through ends as an error within the limit, and stale messages die with the group afterwards;
- each call posts its shape in the store under (sender, receiver, n); a blocking call, and the `wait()` of
  an isend/irecv, first waits for its counterpart's post (a peer that finished, or the limit, ends the
  wait) and compares: sizes that differ are an error on both ranks before gloo sees them.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable

import torch.distributed as dist

from ddp_lib.check._collective_guard import CollectiveMismatch, Guard, _describe
from ddp_lib.comm import SENDING, is_world


class MatchedWork:
    """An isend/irecv handle whose wait() first matches the call with its counterpart (`before_wait`)."""

    def __init__(self, work: Any, before_wait: Callable[[], None]):
        self._work, self._before = work, before_wait

    def wait(self, *args, **kwargs):
        """Match with the counterpart (bounded by the limit), then wait for the transfer."""
        self._before()
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class P2P:
    """The side group and the matching of one property's point-to-point calls."""

    def __init__(self, guard: Guard):
        self.guard = guard
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=guard.timeout_s))
        self._count: dict[tuple, int] = {}

    def close(self) -> None:
        """Drop the side group (and any message a mistake left in flight)."""
        dist.destroy_process_group(self.group)

    def call(self, name: str, fn: Callable, args: tuple, kwargs: dict):
        """Run send/recv/isend/irecv `fn` guarded; calls on another group or from any source pass through."""
        sending = name in SENDING
        peer = args[1] if len(args) > 1 else kwargs.get("dst" if sending else "src")
        if not is_world(kwargs.get("group")) or peer is None or not args:
            return fn(*args, **kwargs)
        me = self.guard.rank
        src, dst = (me, peer) if sending else (peer, me)
        slot = (src, dst, sending)
        n = self._count.get(slot, 0)
        self._count[slot] = n + 1
        key = f"p2p/{src}-{dst}/{n}/"
        mine, other = ("send", "recv") if sending else ("recv", "send")
        store = self.guard.store
        store.set(key + mine, _describe(args[0]).encode())
        what = f"{name} {'to' if sending else 'from'} rank {peer} #{n + 1}"
        kwargs = {**kwargs, "group": self.group}
        if len(args) > 1:  # peer given positionally: keep it, as a global rank (the side group spans all ranks)
            args = (args[0], peer) + tuple(args[2:])

        def match() -> None:
            theirs = self._wait(key + other, peer, what, key + "fate")
            if theirs != _describe(args[0]):
                raise CollectiveMismatch(f"{what}: this rank {_describe(args[0])}, rank {peer} {theirs}")
            if store.compare_set(key + "fate", "", "go") != b"go":
                raise CollectiveMismatch(f"{what}: rank {peer} stopped waiting (past the limit)", secondary=True)

        if name in ("send", "recv"):
            match()
            return fn(*args, **kwargs)
        if store.check([key + other]) and store.get(key + other).decode() != _describe(args[0]):
            match()  # raises: never hand gloo two sizes that differ
        return MatchedWork(fn(*args, **kwargs), match)

    def _wait(self, key: str, peer: int, what: str, fate: str) -> str:
        store, deadline, pause = self.guard.store, time.monotonic() + self.guard.timeout_s, 0.0
        while not store.check([key]):
            if store.check([f"done/{peer}"]) and not store.check([key]):
                store.compare_set(fate, "", "abandoned")
                raise CollectiveMismatch(f"{what}: rank {peer} finished without the matching call", secondary=True)
            if time.monotonic() > deadline:
                if store.compare_set(fate, "", "abandoned") == b"go":
                    continue
                raise CollectiveMismatch(f"{what}: no matching call on rank {peer} within {self.guard.timeout_s:g} s "
                                         "(both ranks receiving first? a send without its receive?)")
            time.sleep(pause)
            pause = min(0.005, pause + 0.0002)
        return store.get(key).decode()

