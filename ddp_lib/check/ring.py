"""Lesson 01's checker: `check_ring_allreduce(fn)`, a ring all-reduce written from send/recv.

The framework's guard compares collectives, not point-to-point calls, and a blocking gloo `send` whose
peer never receives waits for ever (measured on torch 2.13: two ranks that both `send` first hang at
any size). So while the learner's ring runs, `send`/`recv`/`isend`/`irecv` go through a handshake in the
store. A sender announces each send before the real call; a receiver waits for the matching
announcement, then *commits* (says its real receive follows at once) and receives; a blocking `send`,
or an `isend`'s `wait()`, waits for that commit before it may block. A ring where every rank sends
first, or receives from a rank that never sends to it, then fails within the timeout before any real
call can block, and the group stays usable. The real calls carry a tag of their own per check, so a
message left unmatched by a failed ring is never taken by a later receive.

`batch_isend_irecv` is wrapped too: a point-to-point call made outside it fails "send and receive posted
together" (gloo happens to finish an isend followed by a blocking recv; NCCL needs the two in one group, or
it can deadlock). Where the backend does not coalesce (gloo), the batch makes one isend/irecv call per op,
so its requests are the handshake's, and a request the ring never waits on fails "every request waited".
Under NCCL the works a batch returns are torch's own: counted and tagged, not matched, so a wrong batched
ring can still block there.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddp_lib.check._collective_guard import P2P, swap_in
from ddp_lib.comm import is_world
from ddp_lib.check._p2p import MatchedWork
from ddp_lib.check._runner import CheckResult, Mismatch, Property, _timeout, collectives, run_check
from ddp_lib.devices import comm_device, needs_process_group

P2P_WAIT_S = 20.0  # a correct ring's peer announces within milliseconds; a shared CPU may stall it for seconds
_runs = itertools.count()
_pending: list = []  # the learner's isend works: kept alive until the next check, so an abandoned send still arrives


class _Handshake:
    """Wrap the point-to-point calls: count bytes sent, and refuse a call that would block for ever."""

    def __init__(self, store: dist.Store, rank: int, wait_s: float, tag: int):
        self.store, self.rank, self.wait_s, self.tag = store, rank, wait_s, tag
        self.sent_bytes, self.sends = 0, 0
        self._n: dict[str, int] = {}
        self._inside = False
        self._batched = False  # inside dist.batch_isend_irecv
        self.unbatched: list[str] = []  # p2p calls made outside a batch (NCCL may deadlock on them)
        self.requests: list[_Request] = []  # every isend/irecv request handed to the learner

    def _announce(self, kind: str, src: int, dst: int) -> int:
        key = f"{kind}/{src}->{dst}"
        self._n[key] = self._n.get(key, 0) + 1
        self.store.add(key, 1)
        return self._n[key]

    def _await(self, kind: str, src: int, dst: int, k: int, what: str) -> None:
        key, peer = f"{kind}/{src}->{dst}", src if kind == "send" else dst  # whose call we wait for
        deadline = time.monotonic() + self.wait_s
        while self.store.add(key, 0) < k:
            if self.store.check([f"stopped/{peer}"]):
                raise Mismatch(f"{what}: rank {peer} stopped before the matching call")
            if time.monotonic() > deadline:
                raise Mismatch(f"{what}: rank {peer} made no matching {'send' if kind == 'send' else 'receive'} "
                               f"within {self.wait_s:g} s (would hang)")
            time.sleep(0.001)

    def stopped(self) -> None:
        """Tell the peers this rank will make no more calls (it raised)."""
        self.store.set(f"stopped/{self.rank}", b"1")

    def install(self, spaces: list[dict]) -> list[tuple[dict, str, object]]:
        """Replace the p2p functions (by identity) in `spaces`; return what to restore."""
        self._real = {n: getattr(dist, n) for n in P2P}
        mine = {name: self._outermost(name, fn) for name, fn in
                {"send": self._send, "isend": self._isend, "recv": self._recv, "irecv": self._irecv}.items()}
        mine["batch_isend_irecv"] = self._batch
        return swap_in(spaces, self._real, mine)  # under the framework's guard wrappers too

    def _track(self, name: str, work, before_wait):
        if work is None:
            return work
        req = _Request(work, before_wait, name)
        self.requests.append(req)
        return req

    @staticmethod
    def _peer(rank, group, kw, key):  # batch_isend_irecv passes the peer as group_dst/group_src
        if rank is None and kw.get(key) is not None:
            rank = kw[key] if is_world(group) else dist.get_global_rank(group, kw[key])
        return rank

    # a receive is "committed" once its real call is certain to follow: only then may a send block on it
    def _send(self, tensor, dst=None, group=None, tag=0, **kw):
        to = self._peer(dst, group, kw, "group_dst")
        k = self._announce("send", self.rank, to)
        self._count(tensor)
        self._await("commit", self.rank, to, k, f"blocking send to rank {to}")  # every rank sending first: no
        return self._real["send"](tensor, dst, group, tag=self.tag + tag, **kw)

    def _isend(self, tensor, dst=None, group=None, tag=0, **kw):
        to = self._peer(dst, group, kw, "group_dst")
        k = self._announce("send", self.rank, to)
        self._count(tensor)
        work = self._real["isend"](tensor, dst, group, tag=self.tag + tag, **kw)
        _pending.append(work)  # a dropped Work may cancel its send, which the peer has committed to receive
        if work is None:  # inside batch_isend_irecv: the batch returns the works
            return work
        return self._track(f"isend to rank {to}", work,
                           lambda: self._await("commit", self.rank, to, k, f"isend to rank {to}"))

    def _recv(self, tensor, src=None, group=None, tag=0, **kw):
        frm = self._peer(src, group, kw, "group_src")
        if frm is None:  # from any rank: nothing to match
            return self._real["recv"](tensor, src, group, tag=self.tag + tag, **kw)
        k = self._announce("recv", frm, self.rank)
        self._await("send", frm, self.rank, k, f"recv from rank {frm}")
        self._announce("commit", frm, self.rank)
        return self._real["recv"](tensor, src, group, tag=self.tag + tag, **kw)

    def _irecv(self, tensor, src=None, group=None, tag=0, **kw):
        frm = self._peer(src, group, kw, "group_src")
        work = self._real["irecv"](tensor, src, group, tag=self.tag + tag, **kw)
        if frm is None:
            return work
        k = self._announce("recv", frm, self.rank)
        self._announce("commit", frm, self.rank)  # the receive is posted: a send to it completes
        if work is None:
            return work
        return self._track(f"irecv from rank {frm}", work,
                           lambda: self._await("send", frm, self.rank, k, f"irecv from rank {frm}"))

    def _batch(self, ops):
        self._batched = True
        try:
            return self._real["batch_isend_irecv"](ops)
        finally:
            self._batched = False

    def _outermost(self, name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            if self._inside:  # torch builds recv from irecv (and send from isend): one handshake per call
                return self._real[name](*args, **kwargs)
            self._inside = True
            if not self._batched:
                self.unbatched.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = False
        return call

    def _count(self, tensor: torch.Tensor) -> None:
        self.sent_bytes += tensor.numel() * tensor.element_size()
        self.sends += 1


class _Request(MatchedWork):
    """A request handed to the learner: remembers whether it was waited on (wait(), or its future taken)."""

    def __init__(self, work, before_wait, name: str):
        super().__init__(work, before_wait)
        self.name, self.waited = name, False

    def wait(self, *args, **kwargs):
        self.waited = True
        return super().wait(*args, **kwargs)

    def get_future(self, *args, **kwargs):
        self.waited = True  # torch.futures.wait_all on it
        return self._work.get_future(*args, **kwargs)


def _inputs(numel: int, trial: int, world_size: int, device: torch.device) -> list[torch.Tensor]:
    """Every rank's input of one trial (small integers: any summation order gives the exact sum)."""
    return [torch.randint(-8, 9, (numel,), generator=torch.Generator().manual_seed(1000 * trial + r)).float()
            .to(device) for r in range(world_size)]


@needs_process_group
def check_ring_allreduce(fn: Callable[[torch.Tensor], torch.Tensor | None], timeout_s: float | None = None,
                         quiet: bool = False) -> CheckResult:
    """`fn(x)` sums the float32 tensor `x` over all ranks in place, with point-to-point calls only (a ring)."""
    r = _RingCheck(fn, timeout_s)
    sum_ok = ("sum on every rank",)
    props = [
        Property("sum on every rank", r.sums, "reduce-scatter adds into chunk (r-s-1)%n, all-gather overwrites chunk "
                 "(r-s)%n, n-1 steps each; post each step's send and receive together (a blocking send on every "
                 "rank waits for ever)"),
        Property("send and receive posted together", r.batched,
                 "give each step's isend and irecv to one dist.batch_isend_irecv call: NCCL needs sends and receives "
                 "that progress together in one group, or both ranks wait for ever", needs=sum_ok),
        Property("every request waited", r.waited,
                 "wait() on every request batch_isend_irecv returns, the send's too: until then the send buffer is "
                 "still in flight, and the next step (or the caller) may overwrite it", needs=sum_ok),
        Property("in place", r.in_place, "write into x's chunks (views from tensor_split) and return x", needs=sum_ok),
        Property("point-to-point only", r.p2p_only, "only send/recv/isend/irecv: dist.all_reduce is what you build",
                 needs=sum_ok),
        Property("sends 2(n-1)/n of the buffer", r.ring_bytes, "one chunk per step, never the whole buffer",
                 needs=sum_ok + ("point-to-point only",)),
    ]
    return run_check("ring all-reduce", props, timeout_s, quiet=quiet, warm_up=False)  # no optimizer


class _RingCheck:
    """The setup (this rank's trials, a fresh store prefix and tag per run) and one method per property's evidence;
    `sums` runs the ring and records what the other rows read."""

    def __init__(self, fn: Callable, timeout_s: float | None) -> None:
        self.fn = fn
        self.rank, self.ws = dist.get_rank(), dist.get_world_size()
        self.device = comm_device()
        _pending[:] = [w for w in _pending if w is not None and not w.is_completed()]
        self.run = next(_runs)
        self.store = dist.PrefixStore(f"ddp_check_ring/{self.run}/", c10d._get_default_store())
        self.wait_s = min(_timeout(timeout_s), P2P_WAIT_S)
        # large: 256 KiB per rank
        self.sizes = {"even": 4 * self.ws * 64, "uneven": 4 * self.ws * 64 + 1, "large": 2**16 * self.ws}
        self.seen: dict = {}

    def sums(self) -> float:
        worst, wrong = 0.0, []
        for trial, (label, numel) in enumerate(self.sizes.items()):
            xs = _inputs(numel, trial, self.ws, self.device)
            want, x = sum(xs), xs[self.rank].clone()
            hs = _Handshake(dist.PrefixStore(f"{trial}/", self.store), self.rank, self.wait_s,
                            tag=1000 * (self.run + 1))
            restore = hs.install([vars(dist), vars(c10d), getattr(self.fn, "__globals__", {})])
            try:
                out = self.fn(x)
            except BaseException as e:
                hs.stopped()
                self.seen["not written"] = isinstance(e, NotImplementedError)
                raise
            finally:
                for space, key, value in reversed(restore):
                    space[key] = value
            got = out if isinstance(out, torch.Tensor) else x
            if got.shape != want.shape:
                raise Mismatch(f"{label} buffer: result has shape {list(got.shape)}, expected {list(want.shape)}")
            diff = (got.double() - want.double()).abs().max().item()
            self.seen[label] = dict(in_place=torch.equal(x, want), sent=hs.sent_bytes, sends=hs.sends, numel=numel,
                                    unbatched=sorted(set(hs.unbatched)),
                                    unwaited=[q.name for q in hs.requests if not q.waited])
            if diff > 0 and not wrong:
                wrong.append(Mismatch(f"{label} buffer ({numel} elements): sum off by up to {diff:g}", diff))
            worst = max(worst, diff)
        self.seen["collectives"] = [c for c in collectives() if c not in P2P]
        if wrong:  # raised after every trial ran, so the other rows still have their measurements
            wrong[0].diff = worst
            raise wrong[0]
        return worst

    def ran(self) -> dict:
        if self.seen.get("not written"):
            raise NotImplementedError("your turn")
        if "even" not in self.seen or "large" not in self.seen:
            raise Mismatch("not checked: the ring did not finish (first row)")
        return self.seen

    def in_place(self) -> None:
        wrong = [k for k in self.sizes if not self.ran()[k]["in_place"]]
        if wrong:
            raise Mismatch(f"x does not hold the sum afterwards ({', '.join(wrong)} buffer)")

    def p2p_only(self) -> None:
        if self.ran().get("collectives"):
            raise Mismatch(f"called {', '.join(sorted(set(self.seen['collectives'])))}")

    def ring_bytes(self) -> float:
        s = self.ran()["even"]
        expected = 2 * (self.ws - 1) * (s["numel"] // self.ws) * 4
        ratio = s["sent"] / (s["numel"] * 4)
        if s["sent"] != expected:
            raise Mismatch(f"sent {s['sent']} bytes = {ratio:.2f} x the buffer in {s['sends']} sends, expected "
                           f"2(n-1)/n = {2 * (self.ws - 1) / self.ws:.2f} x", abs(s["sent"] - expected) / (s["numel"] * 4))
        return 0.0

    def batched(self) -> None:
        calls = sorted({c for k in self.sizes for c in self.ran()[k]["unbatched"]})
        if calls:
            raise Mismatch(f"on NCCL this can deadlock: post the send and the receive together (dist.batch_isend_irecv); "
                           f"this ring called {', '.join(calls)} outside a batch")

    def waited(self) -> None:
        left = [n for k in self.sizes for n in self.ran()[k]["unwaited"]]
        if left:
            raise Mismatch(f"{len(left)} request(s) never waited on, e.g. {left[0]}")
