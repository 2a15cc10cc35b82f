"""The collective guard: every rank's collectives are compared through the store *before* they run.

While a check runs, the `torch.distributed` collectives (and every alias of them in the learner's namespace)
are replaced by wrappers; the package's own collectives reach them too, since `ddp_lib.comm` looks each one up in
`torch.distributed` when it is called, and the guard registers with that layer (`comm.observe`) so that the
package knows a checker compares every call (FSDP's entry agreement then stands aside) and a mismatch names the
package's label of the call. Before a collective runs, each rank posts its
signature (op, shapes, dtypes, reduce op, source rank) under the collective's sequence number in the
default group's store, then waits for its peers' signatures:
- signatures that differ raise `CollectiveMismatch` on every rank *before* the collective runs (gloo
  aborts the whole process, SIGABRT, when sizes differ: no `try` could catch that afterwards);
- a peer that has already finished the property (it posted its result: it skipped this call, or raised)
  raises at once on the waiting rank: a skipped call never hangs;
- a peer that posts nothing within the timeout raises too.
So a mistake never reaches the process group, which stays healthy for the next cell and the next check.
It is what `TORCH_DISTRIBUTED_DEBUG=DETAIL`'s wrapper does in C++, in Python and with a short timeout.
Collectives issued from C++ (torch's own DDP reducer) or through `ProcessGroup` objects are not seen.
"""

from __future__ import annotations

import inspect
import pickle
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddp_lib import comm
from ddp_lib.comm import KINDS, P2P, RENAMED, group_ranks

#: collectives whose tensor shapes, dtypes, reduce op and source must agree on every rank of the group
STRICT = tuple(n for n, k in KINDS.items() if k == "strict")
#: collectives whose shapes may legitimately differ per rank: only the op's name is compared
LOOSE = tuple(n for n, k in KINDS.items() if k == "loose")


#: flat collectives (output, input): one side must hold world_size x the other (gloo aborts with a C++ check)
FLAT = {name: "gather" if "gather" in name else "scatter" for pair in RENAMED.items() for name in pair}


def _check_flat(name: str, args: tuple, kwargs: dict, n: int) -> None:
    """Refuse, before it runs, a flat all-gather / reduce-scatter whose sizes do not fit the group."""
    out = args[0] if len(args) > 0 else kwargs.get("output_tensor", kwargs.get("output"))
    inp = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
    if not (isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor)):
        return
    big, small = (out, inp) if FLAT[name] == "gather" else (inp, out)
    if big.numel() != n * small.numel():
        what = "output" if FLAT[name] == "gather" else "input"
        raise ValueError(f"{name}: the {what} holds {big.numel()} elements, but world_size ({n}) x "
                         f"{small.numel()} = {n * small.numel()} are needed"
                         + ("" if FLAT[name] == "gather" else ": pad the input to a multiple of world_size "
                            "and make the output 1/world_size of it"))


class CollectiveMismatch(RuntimeError):
    """A collective that would desynchronise the ranks; `secondary` when another rank caused it."""

    def __init__(self, message: str, secondary: bool = False):
        super().__init__(message)
        self.secondary = secondary


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if isinstance(x, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in x):
        return "[" + ", ".join(_describe(t) for t in x) + "]"
    return ""


def signature(op: str, args: tuple, kwargs: dict) -> str:
    """What must agree across ranks for `op(*args, **kwargs)` to be a matched collective."""
    if op not in STRICT:
        return op
    parts = [d for d in (_describe(a) for a in list(args) + list(kwargs.values())) if d]
    for key in ("op", "src", "dst"):
        if key in kwargs:
            parts.append(f"{key}={str(kwargs[key]).replace('RedOpType.', '')}")
    if op == "broadcast" and len(args) > 1:
        parts.append(f"src={args[1]}")
    if op in ("all_reduce", "reduce") and "op" not in kwargs:
        extra = [a for a in args[1:] if not isinstance(a, (torch.Tensor, int))]
        parts.append(f"op={str(extra[0]).replace('RedOpType.', '') if extra else 'SUM'}")
    return f"{op}({', '.join(parts)})"


def _group_of(fn: Callable, args: tuple, kwargs: dict):
    """The `group` a collective call names, by keyword or by position (None: the default group)."""
    if "group" in kwargs:
        return kwargs["group"]
    try:
        return inspect.signature(fn).bind_partial(*args, **kwargs).arguments.get("group")
    except (TypeError, ValueError):
        return None


def swap_in(spaces: list[dict], real: dict[str, Callable], mine: dict[str, Callable]) -> list[tuple[dict, str, Any]]:
    """In each namespace of `spaces`, replace every value that is `real[name]`, or wraps the same function (as the
    guard's own wrappers do), by `mine[name]`; return the `(space, key, old value)` to put back, in order."""
    base = {name: inspect.unwrap(fn) for name, fn in real.items()}
    restore = []
    for space in spaces:
        for key, value in list(space.items()):
            for name, fn in real.items():
                if callable(value) and (value is fn or inspect.unwrap(value) is base[name]):
                    restore.append((space, key, value))
                    space[key] = mine[name]
    return restore


class Guard:
    """Installs the wrappers for one property; `calls` lists the collectives this rank issued in it."""

    compares_every_call = True  # what `ddp_lib.comm.compared()` reports while the guard observes the layer

    def __init__(self, store: dist.Store, rank: int, world_size: int, timeout_s: float,
                 namespaces: list[dict] = ()):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.calls: list[str] = []
        self.blocking: list[bool] = []  # per call: issued without async_op=True (it returned only once done)
        self.waits = 0  # Work.wait() calls this rank made in the property (on any collective's handle)
        self.groups: list[tuple[int, ...]] = []  # the global ranks of each call's group, beside `calls`
        self._seq: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._namespaces = list(namespaces)
        self._restore: list[tuple[dict, str, Any]] = []
        self.p2p = None  # a _p2p.P2P when the property guards point-to-point calls
        self._observing = comm.observe(self)

    # -- installing ----------------------------------------------------------------------------------
    def __enter__(self) -> "Guard":
        originals = {id(getattr(dist, n)): n for n in KINDS if hasattr(dist, n)}
        self._orig = {n: getattr(dist, n) for n in originals.values()}
        # the package's calls look torch.distributed up when made (ddp_lib.comm): no module of ours needs rewriting
        spaces = [vars(dist), vars(c10d)] + self._namespaces
        seen: set[int] = set()
        for space in spaces:
            if id(space) in seen:
                continue
            seen.add(id(space))
            for key, value in list(space.items()):
                name = originals.get(id(value)) if callable(value) else None
                if name is not None:
                    self._restore.append((space, key, value))
                    space[key] = self._wrap(name, value)
        # every handle's wait() is counted: a checker can tell a handle waited for inside backward (in the hook
        # that launched it: nothing overlaps) from one waited for after backward
        self._real_wait = real_wait = dist.Work.wait

        def counted_wait(work, *args, **kwargs):
            self.waits += 1
            return real_wait(work, *args, **kwargs)

        counted_wait.__wrapped__ = real_wait
        dist.Work.wait = counted_wait
        self._observing.__enter__()
        return self

    def before_collective(self, kind: str, payload: Any, group: Any, label: str | None) -> None:
        """The package's layer is about to issue a collective: remember its label for a mismatch message."""
        self._local.label = label

    def __exit__(self, *exc) -> None:
        self._observing.__exit__(None, None, None)
        self._observing = comm.observe(self)
        dist.Work.wait = self._real_wait
        for space, key, value in reversed(self._restore):
            space[key] = value
        self._restore.clear()

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def guarded(*args, **kwargs):
            if getattr(self._local, "inside", False):  # a collective built from others: checked once, outside
                return fn(*args, **kwargs)
            self.calls.append(name)
            self.blocking.append(not kwargs.get("async_op", False))
            group = _group_of(fn, args, kwargs)
            self.groups.append(self._ranks(group))
            if name in FLAT:
                _check_flat(name, args, kwargs, len(self.groups[-1]))
            if name not in P2P:
                self._agree(name, args, dict(kwargs, group=group))
            self._local.inside = True
            try:
                if name in P2P and self.p2p is not None and name != "batch_isend_irecv":
                    return self.p2p.call(name, fn, args, kwargs)
                return fn(*args, **kwargs)
            finally:
                self._local.inside = False

        guarded.__wrapped__ = fn
        return guarded

    # -- comparing -----------------------------------------------------------------------------------
    def _ranks(self, group) -> tuple[int, ...]:
        return group_ranks(group)

    def _agree(self, name: str, args: tuple, kwargs: dict) -> None:
        group = kwargs.pop("group", None)
        ranks = self._ranks(group)
        with self._lock:
            seq = self._seq.get(ranks, 0)
            self._seq[ranks] = seq + 1
        tag = "-".join(map(str, ranks)) if len(ranks) != self.world_size else "world"
        key = f"sig/{tag}/{seq}/"
        mine = signature(name, args, kwargs)
        label, self._local.label = getattr(self._local, "label", None), None
        if label:
            mine += f" in {label}"
        self.store.set(key + str(self.rank), mine.encode())
        theirs = {self.rank: mine}
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        fate = key + "fate"  # first writer wins: "go" (everyone arrived) or "abandoned" (someone gave up)
        for peer in ranks:
            if peer == self.rank:
                continue
            while not self.store.check([key + str(peer)]):
                # the peer may have posted its signature just before finishing: look once more
                if self.store.check([f"done/{peer}"]) and not self.store.check([key + str(peer)]):
                    self.store.compare_set(fate, "", "abandoned")
                    raise CollectiveMismatch(
                        f"{name} #{seq + 1}: rank {peer} finished without calling it "
                        f"(a collective skipped on one rank, or rank {peer} raised)", secondary=True)
                if time.monotonic() > deadline:
                    if self.store.compare_set(fate, "", "abandoned") == b"go":
                        continue  # everyone had arrived after all: the peer's signature is there
                    raise CollectiveMismatch(f"{name} #{seq + 1}: rank {peer} did not reach it within "
                                             f"{self.timeout_s:g} s (a collective skipped on one rank?)")
                time.sleep(pause)
                pause = min(0.005, pause + 0.0002)
            theirs[peer] = self.store.get(key + str(peer)).decode()
        if len({sig.split(" in ")[0] for sig in theirs.values()}) > 1:  # the label only explains
            seen = ", ".join(f"rank {r}: {s}" for r, s in sorted(theirs.items()))
            raise CollectiveMismatch(f"collective #{seq + 1} differs across ranks ({seen})")
        if self.store.compare_set(fate, "", "go") != b"go":  # a peer gave up on this call: never enter it alone
            raise CollectiveMismatch(f"{name} #{seq + 1}: a rank stopped waiting for this rank "
                                     f"(it arrived after the {self.timeout_s:g} s limit)", secondary=True)

    def post_done(self, payload: Any) -> None:
        """Tell the peers this rank has finished the property (what a waiting rank looks for)."""
        self.store.set(f"done/{self.rank}", pickle.dumps(payload))

    def gather_done(self) -> dict[int, Any]:
        """Every rank's posted payload (a rank silent for the timeout maps to None)."""
        out, deadline = {}, time.monotonic() + self.timeout_s
        for r in range(self.world_size):
            while r not in out:
                if self.store.check([f"done/{r}"]):
                    out[r] = pickle.loads(self.store.get(f"done/{r}"))
                elif time.monotonic() > deadline:
                    out[r] = None
                else:
                    time.sleep(0.002)
        return out
