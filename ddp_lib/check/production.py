"""Checkers of lesson 09: a collective guard through the store, a shadow step for uneven inputs, a compression hook."""

from __future__ import annotations

import itertools
import re
from math import inf
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib.check._deadline import TimedOut, short_timeout_store, time_limit
from ddp_lib.check._runner import CheckResult, Mismatch, Property, _timeout, collectives, max_diff, run_check
from ddp_lib.check.basics import _grads, _model, _params, _rank_ws
from ddp_lib.comm import spy_on
from ddp_lib.ddp.bucketed import Bucket, BucketedDDP
from ddp_lib.ddp.comm_hook import HookBucket
from ddp_lib.devices import comm_device, needs_process_group
from ddp_lib.kit.models import ToyModel

_runs = itertools.count()  # one per check_collective_guard call, on every rank alike: its keys never meet a past run's
STORE_TIMEOUT_S = 5.0  # a get/wait on the store the guard is handed gives up after this (not the default 30 min)
GRACE_S = 5.0  # how long past its own timeout a guard may run before the check interrupts it


def _names_rank(message: str, r: int) -> bool:
    return "rank" in message.lower() and re.search(rf"\b{r}\b", message) is not None


@needs_process_group
def check_collective_guard(guard: Callable, timeout_s: float | None = None) -> CheckResult:
    """`guard(store, key, op, tensor, timeout_s)` returns when every rank called it with the same (op, shape,
    dtype) under `key`; otherwise it raises, on every rank that called it, within about `timeout_s`, with a message
    naming each rank that disagrees with rank 0, and what that rank called where it differs (its op, or its dtype;
    for a shape, the op), or each rank that never came. It talks through the store only."""
    g = _GuardCheck(guard, timeout_s)
    first = ("agrees through the store",)
    return run_check("collective guard", [
        Property("agrees through the store", g.agree,
                 "set your (op, shape, dtype) under key/rank, wait for every rank's, compare; never a collective"),
        Property("names a shape mismatch", g.shape_differs,
                 "compare the shapes too, and raise on every rank with a message naming the rank that differs and the op",
                 needs=first, ranks=2),
        Property("names a different op", g.op_differs, "compare the op names; say which op the differing rank called",
                 needs=first, ranks=2),
        Property("names a dtype mismatch", g.dtype_differs,
                 "compare the dtypes; say the differing rank's (str(tensor.dtype))",
                 needs=first, ranks=2),
        Property("names a missing rank in bounded time", g.missing,
                 "store.get waits for a key that never comes: poll store.check against a deadline; on timeout "
                 "name the ranks whose key is absent", needs=first, ranks=2),
    ], timeout_s)


class _GuardCheck:
    """The setup (this rank, the last one, a store connection of its own, a fresh key prefix) and one method per
    property's evidence."""

    def __init__(self, guard: Callable, timeout_s: float | None) -> None:
        self.guard = guard
        self.rank, self.ws = _rank_ws()
        self.last = self.ws - 1
        # its own connection, whose blocking get/wait give up after seconds: a guard with no deadline cannot freeze
        self.store = short_timeout_store(dist.distributed_c10d._get_default_store(),
                                         min(STORE_TIMEOUT_S, 0.5 * _timeout(timeout_s)))
        self.dev = comm_device()
        self.run = next(_runs)

    def call(self, name: str, op: str, t: torch.Tensor, wait_s: float = 5.0) -> Exception | None:
        # named keys, not a running count: a property that stops early on one rank (a guard that raised there only)
        # leaves no rank's later keys out of step, in this check or a re-run of it
        key = f"lesson09-guard/{self.run}/{name}"
        try:
            with time_limit(wait_s + GRACE_S, "the guard"):
                self.guard(self.store, key, op, t, wait_s)
        except NotImplementedError:
            raise
        except TimedOut as e:
            raise Mismatch(f"{e} for a {wait_s:g} s timeout: it waits with no deadline") from None
        except Exception as e:  # noqa: BLE001 - the learner's refusal is the answer here
            return e
        return None

    def agree(self) -> None:
        for op, shape in (("all_reduce", (4,)), ("broadcast", (2, 3))):
            err = self.call(f"agree/{op}", op, torch.zeros(shape, device=self.dev))
            if err is not None:
                raise Mismatch(f"ranks that agree on {op} {shape} float32 were refused: {err}")
        if collectives():
            raise Mismatch(f"the guard issued {collectives()}: a collective can itself hang; use the store")

    def refused(self, name: str, op_of: Callable[[int], str], tensor_of: Callable[[int], torch.Tensor], culprit: str,
                must_say: str) -> None:
        err = self.call(name, op_of(self.rank), tensor_of(self.rank))
        if err is None:
            raise Mismatch(f"rank {self.rank} was let through although rank {self.last} {culprit}: it would run the "
                           "collective and hang or read garbage")
        msg = str(err)
        if not _names_rank(msg, self.last) or must_say not in msg:
            raise Mismatch(f"the message {msg!r} must name rank {self.last} and say {must_say!r}")

    def shape_differs(self) -> None:
        self.refused("shape", lambda r: "all_reduce",
                     lambda r: torch.zeros(5 if r == self.last else 4, device=self.dev),
                     "passed a tensor of 5 elements", "all_reduce")

    def op_differs(self) -> None:
        self.refused("op", lambda r: "broadcast" if r == self.last else "all_reduce",
                     lambda r: torch.zeros(4, device=self.dev),
                     "called broadcast", "broadcast")

    def dtype_differs(self) -> None:
        self.refused("dtype", lambda r: "all_reduce",
                     lambda r: torch.zeros(4, device=self.dev, dtype=torch.float64 if r == self.last else torch.float32),
                     "passed float64", "float64")

    def missing(self) -> None:
        if self.rank == self.last:
            return  # this rank never reaches the collective
        start = time.monotonic()
        err = self.call("missing", "all_reduce", torch.zeros(4, device=self.dev), wait_s=0.5)
        took = time.monotonic() - start
        if err is None:
            raise Mismatch(f"rank {self.last} never called the guard, yet rank {self.rank} was let through")
        if took > 2.0:
            raise Mismatch(f"the guard took {took:.1f} s for a 0.5 s timeout ({type(err).__name__}): poll "
                           "against a deadline")
        if not _names_rank(str(err), self.last):
            raise Mismatch(f"the message {str(err)!r} must name rank {self.last}, the one that never came")


def _uneven_batch(step: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 10 * step + r)
    dev = comm_device()
    return torch.randn(4, 8, generator=g).to(dev), torch.randint(0, 3, (4,), generator=g).to(dev)


@needs_process_group
def check_shadow_step(step_fn: Callable, timeout_s: float | None = None) -> CheckResult:
    """`step_fn(model, batch)` is one synchronizing step on uneven inputs: `batch` is `(x, y)`, or None once this
    rank is out of data. It returns how many ranks had data; when that is > 0, every rank's `.grad` holds the
    gradient averaged over the ranks that had data (a rank without data contributes zeros), so that every rank may
    take the optimizer step; when it is 0, every rank stops, at the same call."""
    rank, ws = _rank_ws()

    def train(counts: tuple[int, ...]) -> tuple[list[int], dict]:
        model = _model(_shadow_toy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        returned = []
        for step in range(max(counts) + 3):
            opt.zero_grad(set_to_none=False)
            active = step_fn(model, _uneven_batch(step, rank) if step < counts[rank] else None)
            returned.append(active)
            if not active:
                break
            opt.step()
        return returned, _params(model)

    def stops() -> None:
        counts = _shadow_counts("one short", ws)
        returned, _ = train(counts)
        want = [sum(step < c for c in counts) for step in range(max(counts))] + [0]
        if returned != want:
            raise Mismatch(f"step_fn returned {returned} on rank {rank}; expected {want} (ranks with data per "
                           "step, then 0 on every rank once all are out)")

    def union(kind: str) -> Callable[[], float]:
        def run() -> float:
            counts = _shadow_counts(kind, ws)
            _, got = train(counts)
            return max_diff(got, _shadow_reference(counts, ws), what="parameter ")
        return run

    return run_check("shadow step", [
        Property("stops together, counting ranks with data", stops,
                 "all-reduce a 'has data' flag (1 or 0) first, every step, on every rank; return its sum", ranks=2),
        Property("equal to training on the union", union("one short"),
                 "divide the summed gradients by the number of ranks with data, not by world_size",
                 needs=("stops together, counting ranks with data",), ranks=2),
        Property("a rank with no data at all", union("no data"),
                 "a rank without data still all-reduces zeros for every gradient",
                 needs=("equal to training on the union",), ranks=2),
    ], timeout_s)


def _shadow_toy() -> nn.Module:
    return ToyModel(8, 16, 3)


def _shadow_reference(counts: tuple[int, ...], ws: int) -> dict:
    """One process training on the union of the ranks' uneven batches: the parameters the shadow step must give."""
    model = _model(_shadow_toy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(max(counts)):
        have = [r for r in range(ws) if step < counts[r]]
        opt.zero_grad()
        (sum(F.cross_entropy(model(x), y) for x, y in (_uneven_batch(step, r) for r in have)) / len(have)
         ).backward()
        opt.step()
    return _params(model)


def _shadow_counts(kind: str, ws: int) -> tuple[int, ...]:
    """Each rank's number of batches: "one short" (rank 0 has one more), or "no data" (the last rank has none)."""
    if kind == "one short":
        return tuple(3 if r == 0 else 2 for r in range(ws))
    return tuple(0 if r == ws - 1 else 2 for r in range(ws))


@needs_process_group
def check_compression_hook(hook: Callable, timeout_s: float | None = None) -> CheckResult:
    """`hook(state, bucket)` returns a `torch.futures.Future` of the bucket's fp32 buffer averaged over ranks,
    having sent it in fp16 or bf16, divided by the world size before the all-reduce (as torch's
    `fp16_compress_hook` does), so that the sum cannot overflow fp16 where the average fits; it runs on
    BucketedDDP's `register_comm_hook` like torch's hooks."""
    c = _CompressionCheck(hook)
    first = ("returns a future of the bucket",)
    return run_check("compression hook", [
        Property("returns a future of the bucket", c.contract,
                 "return dist.all_reduce(..., async_op=True).get_future().then(decompress), decompress giving "
                 "a tensor shaped and typed like bucket.buffer()"),
        Property("the average, to fp16/bf16 precision", c.average,
                 "all-reduce sums: divide by the world size", needs=first, ranks=2),
        Property("no overflow where the average fits fp16", c.no_overflow,
                 "divide before the all-reduce, as torch's fp16_compress_hook does (cast, divide, all-reduce): "
                 "the fp16 sum of world_size gradients overflows to inf past 65504 where their average fits",
                 needs=("the average, to fp16/bf16 precision",), ranks=2),
        Property("compressed on the wire", c.on_wire, "cast bucket.buffer() to fp16 or bf16 before the all-reduce",
                 needs=first),
        Property("runs on BucketedDDP", c.engine, "use only bucket.buffer(); return a future of the whole buffer",
                 needs=("the average, to fp16/bf16 precision",), ranks=2),
    ], timeout_s)


class _CompressionCheck:
    """The setup (the learner's hook, this rank, the dtypes it sent) and one method per property's evidence."""

    def __init__(self, hook: Callable) -> None:
        self.hook = hook
        self.rank, self.ws = _rank_ws()
        self.dev = comm_device()
        self.sent: list[torch.dtype] = []

    def reduced(self, values: torch.Tensor) -> torch.Tensor:
        p = nn.Parameter(torch.zeros_like(values))
        bucket = Bucket([p])
        bucket.buffer.copy_(values)
        with spy_on("all_reduce", lambda tensor, *a, **k: self.sent.append(tensor.dtype)):
            fut = self.hook(None, HookBucket(bucket, 0, 1))
        if not isinstance(fut, (torch.futures.Future, torch._C.Future)):
            raise Mismatch(f"the hook returned {type(fut).__name__}, not a torch.futures.Future "
                           "(use work.get_future().then(...))")
        out = fut.wait()
        if isinstance(out, list):
            out = out[0]
        if not isinstance(out, torch.Tensor) or out.shape != values.shape or out.dtype != values.dtype:
            raise Mismatch(f"the future holds {getattr(out, 'dtype', type(out))} "
                           f"{tuple(getattr(out, 'shape', ()))}; expected the bucket's {values.dtype} "
                           f"{tuple(values.shape)}: decompress before returning")
        return out

    def local(self, r: int) -> torch.Tensor:
        return torch.randn(1000, generator=torch.Generator().manual_seed(7 + r)).to(self.dev)

    def contract(self) -> None:
        self.reduced(self.local(self.rank))

    def average(self) -> float:
        got = self.reduced(self.local(self.rank))
        want = sum(self.local(r) for r in range(self.ws)) / self.ws
        return max_diff({"buffer": got}, {"buffer": want}, tol=2e-2, what="averaged ")

    def no_overflow(self) -> float:
        # each rank's value and the average fit fp16 (max 65504); the sum of world_size of them does not
        big = 0.75 * torch.finfo(torch.float16).max
        values = lambda r: torch.full((64,), big * (1 - 0.01 * r)).to(self.dev)  # noqa: E731
        got = self.reduced(values(self.rank))
        want = sum(values(r) for r in range(self.ws)) / self.ws
        if not torch.isfinite(got).all():
            raise Mismatch(f"every rank sent about {big:.0f}: their sum ({self.ws * big:.0f}) exceeds fp16's largest "
                           f"value (65504) and the hook returned {got[0].item()}: it divided after the sum", inf)
        return max_diff({"buffer": got / want}, {"buffer": torch.ones_like(want)}, tol=2e-2, what="relative ")

    def on_wire(self) -> None:
        self.sent.clear()
        self.reduced(self.local(self.rank))
        if not self.sent or any(d not in (torch.float16, torch.bfloat16) for d in self.sent):
            raise Mismatch(f"all-reduced dtypes {self.sent}: compress to fp16 or bf16 before the all-reduce")

    def engine(self) -> float:
        make = lambda: ToyModel(16, 32, 4, depth=2)  # noqa: E731
        model, ref = _model(make), _model(make)
        ddp = BucketedDDP(model, bucket_size_mb=1e-3, first_bucket_mb=1e-3)  # several buckets
        ddp.register_comm_hook(None, self.hook)
        g = torch.Generator().manual_seed(3)
        n, mine = 8 * self.ws, slice(8 * self.rank, 8 * self.rank + 8)
        x, y = torch.randn(n, 16, generator=g).to(self.dev), torch.randint(0, 4, (n,), generator=g).to(self.dev)
        F.cross_entropy(ref(x), y).backward()
        F.cross_entropy(ddp(x[mine]), y[mine]).backward()
        ddp.finish_gradient_synchronization()
        return max_diff(_grads(model), _grads(ref), tol=2e-2, what="grad of ")


def _mismatched_all_reduce() -> None:
    """Rank r all-reduces r + 4 elements: ranks disagree on the shape."""
    dist.all_reduce(torch.zeros(4 + dist.get_rank()))


def detail_mode_message(timeout_s: float = 30.0) -> str:
    """Run a shape-mismatched all-reduce on 2 fresh gloo ranks under TORCH_DISTRIBUTED_DEBUG=DETAIL; return the
    line of a rank's error that says "Detected mismatch" (DETAIL must be set before the process group exists, hence fresh ranks)."""
    import os

    from ddp_lib.launch import RankError, spawn

    before = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        spawn(_mismatched_all_reduce, world_size=2, timeout_s=timeout_s)
    except RankError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "Detected mismatch" in ln]
        return lines[0] if lines else str(e).splitlines()[-1]
    finally:
        if before is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = before
    return "no error: the ranks agreed"
