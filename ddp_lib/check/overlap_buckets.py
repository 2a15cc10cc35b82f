"""Checkers of lesson 05: the overlap hook (async all-reduce from a gradient hook) and the bucket plan."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib.check._collective_guard import CollectiveMismatch
from ddp_lib.check._runner import CheckResult, Mismatch, Property, blocking, collectives, max_diff, run_check, waits
from ddp_lib.check.basics import SHAPES, _batch, _explain_grads, _grads, _model, _params, _rank_ws
from ddp_lib.kit.data import shard_batch
from ddp_lib.ddp.bucketed import assign_buckets
from ddp_lib.kit.models import ToyModel
from ddp_lib.devices import needs_process_group


@needs_process_group
def check_overlap_hook(cls: Callable[[nn.Module], object], timeout_s: float | None = None) -> CheckResult:
    """`cls(model)` registers gradient hooks that launch async all-reduces; `.finish()` waits and returns the count.

    After backward and `finish()` every gradient must be the average over ranks (equal to one process on the
    full batch, over 2 model shapes), the all-reduces must have been *launched during backward* (by the hooks,
    before `finish()` is called) without blocking (`async_op=True`) and without waiting for a handle before backward
    ends (a `wait()` in the hook serializes backward and communication), and there must be one all-reduce per
    gradient, which `finish()` reports, step after step with the same object (2 steps).
    """
    h = _OverlapHook(cls)
    return run_check("overlap hook", [
        Property("equal to one process", h.equal, "divide by world_size, and wait for every handle before reading"),
        Property("collectives start during backward", h.during_backward,
                 "launch dist.all_reduce(p.grad, async_op=True) inside the hook, keep the handle, wait in finish()",
                 needs=("equal to one process",)),
        Property("one all-reduce per gradient, counted, step after step", h.one_per_gradient,
                 "keep every handle; finish() waits for each, returns how many, and empties the list for the next step",
                 needs=("equal to one process", "collectives start during backward")),
    ], timeout_s)


class _OverlapHook:
    """The setup (the learner's class, this rank), the training run every property reads, and one method per
    property's evidence."""

    def __init__(self, cls: Callable[[nn.Module], object]) -> None:
        self.cls = cls
        self.rank, self.ws = _rank_ws()

    def steps(self, cfg: dict, n: int = 1) -> list[tuple[dict, dict, dict, list[str], list[bool], int, object]]:
        model, ref = _model(lambda: ToyModel(**cfg)), _model(lambda: ToyModel(**cfg))
        engine = self.cls(model)
        out = []
        for step in range(n):
            x, y = _batch(step, in_dim=cfg["in_dim"], classes=cfg["out_dim"])
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            F.cross_entropy(ref(x), y).backward()
            before, waited = len(collectives()), waits()
            x_mine, y_mine = shard_batch(x, self.rank, self.ws), shard_batch(y, self.rank, self.ws)
            F.cross_entropy(model(x_mine), y_mine).backward()
            local = _grads(model)  # with async all-reduces still in flight this may already be averaged: only a hint
            in_backward, blocked, waited = collectives()[before:], blocking()[before:], waits() - waited
            count = engine.finish()
            out.append((_grads(model), _grads(ref), local, in_backward, blocked, waited, count))
        return out

    def equal(self) -> float:
        worst = 0.0
        for cfg in SHAPES.values():
            got, want, local, *_ = self.steps(cfg)[0]
            _explain_grads(got, want, local, self.ws)
            worst = max(worst, max_diff(got, want, what="grad of "))
        return worst

    def during_backward(self) -> None:
        _, _, _, launched, blocked, waited, _ = self.steps(SHAPES["mlp 16-32-4"])[0]
        if not launched:
            raise Mismatch("no collective was issued during backward: the hook must launch the all-reduce")
        if any(blocked):
            raise Mismatch(f"{sum(blocked)} of the {len(blocked)} all-reduces issued in the hooks blocked until done "
                           "(no async_op=True): backward waited for each, so nothing overlapped")
        if waited:
            raise Mismatch(f"{waited} wait() call(s) during backward for the {len(launched)} all-reduces launched in "
                           "the hooks: a hook that waits for its handle stalls backward until the all-reduce is done, "
                           "so nothing overlaps; keep the handle and wait in finish()")

    def one_per_gradient(self) -> None:
        cfg = SHAPES["mlp 16-24-4 x3"]
        n = 2 * (cfg["depth"] + 1)  # a weight and a bias per linear
        for step, (_, _, _, launched, _, _, count) in enumerate(self.steps(cfg, 2), 1):
            if len(launched) != n:
                raise Mismatch(f"step {step}: {len(launched)} collectives during backward for {n} gradients")
            if count != n:
                kept = " (the handles of step 1 were kept: forget them once waited)" if step == 2 and count == 2 * n \
                    else ""
                raise Mismatch(f"step {step}: finish() returned {count!r}, but {n} all-reduces were launched{kept}")


def _rule(params: list, cap: int, first: int, strict: bool = False, nbytes=None) -> list[list]:
    """The bucket rule in the lesson's words (reverse order, close once the cap is reached), with the usual
    mistakes as switches: `strict` closes only above the cap, `nbytes` measures a tensor another way."""
    size_of = nbytes or (lambda p: p.numel() * p.element_size())
    buckets, size = [[]], 0
    for p in reversed(params):
        buckets[-1].append(p)
        size += size_of(p)
        limit = first if len(buckets) == 1 else cap
        if size > limit if strict else size >= limit:
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


@needs_process_group
def check_bucket_plan(fn: Callable[[list, int, int], list], timeout_s: float | None = None) -> CheckResult:
    """`fn(params, cap_bytes, first_cap_bytes)` groups `params` into buckets the way torch DDP does.

    Reverse parameter order; a bucket closes as soon as its bytes reach the cap in force (`first_cap_bytes` for
    the first bucket, `cap_bytes` after), a bucket exactly at the cap included; a tensor larger than the cap is a
    bucket of its own; no collective.
    """
    def same_plan() -> None:
        params = _model_params(3, 32)  # reversed: 16, 512, then (128, 4096) x 3 bytes
        _compare_plan(fn, params, 6000, 6000)
        _compare_plan(fn, params, 9000, 9000)

    def exact_cap() -> None:  # every bucket's bytes are exactly its cap: each closes there
        _compare_plan(fn, _model_params(3, 32), 4224, 528)

    def small_first() -> None:
        _compare_plan(fn, _model_params(3, 32), 9000, 100)  # the first bucket: the head's bias alone

    def larger_than_cap() -> None:
        _compare_plan(fn, _model_params(2, 32), 1000, 1000)  # every weight over the cap: a bucket each

    first = ("same plan as torch DDP's rule",)
    return run_check("bucket plan", [
        Property("same plan as torch DDP's rule", same_plan,
                 "walk reversed(params), add each tensor's bytes (numel() * element_size()) to the open bucket, "
                 "and close it once it reaches the cap (>=), after adding the tensor"),
        Property("small first bucket", small_first,
                 "the first bucket closes at first_cap_bytes, the others at cap_bytes", needs=first),
        Property("a bucket exactly at the cap closes", exact_cap,
                 "compare with >=: a bucket closes as soon as it reaches the cap, not only once it is above it",
                 needs=first + ("small first bucket",)),
        Property("a tensor over the cap is alone", larger_than_cap, "never split a tensor; close the bucket it fills",
                 needs=first),
    ], timeout_s)


def _ids(groups: list) -> list[list[int]]:
    return [[id(p) for p in g] for g in groups]


def _sizes(groups: list) -> list[list[int]]:
    return [[p.numel() * p.element_size() for p in g] for g in groups]


def _model_params(depth: int, width: int) -> list:
    torch.manual_seed(0)
    return list(ToyModel(width, width, 4, depth=depth).parameters())


def _compare_plan(fn: Callable[[list, int, int], list], params: list, cap: int, first: int) -> None:
    """Raise a Mismatch unless `fn` plans `params` as torch DDP's rule does, naming the usual mistake it matches."""
    got = fn(params, cap, first)
    if collectives():
        raise Mismatch(f"planning issued {collectives()}")
    want = assign_buckets(list(reversed(params)), cap, first)
    if _ids(got) == _ids(want):
        return
    why = ""
    if _ids(got) == _ids(_rule(list(reversed(params)), cap, first)):
        why = "forward parameter order: backward produces the last parameters first, walk reversed(params). "
    elif _ids(got) == _ids(_rule(params, cap, first, strict=True)):
        why = "a bucket whose bytes equal the cap stayed open (> where the rule is >=). "
    elif _ids(got) == _ids(_rule(params, cap, first, nbytes=lambda p: p.numel())):
        why = "sizes counted in elements, but the caps are in bytes (numel() * element_size()). "
    elif _ids(got) == _ids(_rule(params, cap, cap)) and first != cap:
        why = "the first bucket closed at cap_bytes instead of first_cap_bytes. "
    raise Mismatch(f"{why}{len(got)} buckets of {_sizes(got)} bytes; expected {len(want)}: {_sizes(want)}")


class _TwoBranch(nn.Module):
    """Two branches; `swap` builds b before a, so that backward (later-built first) delivers a's gradients first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 8), nn.Linear(16, 12), nn.Linear(20, 4)
        self.swap = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swap:
            hb = self.b(x)
            ha = self.a(x)
        else:
            ha, hb = self.a(x), self.b(x)
        return self.head(torch.relu(torch.cat([ha, hb], 1)))


#: _TwoBranch in reverse parameter order is head (16 + 320 B), b (48 + 768 B), a (32 + 512 B): this cap makes a
#: bucket of each (the head's exactly at the cap); on odd ranks the buckets complete in the order head, a, b
TWO_BRANCH_CAP_MB = 336 / 2**20


_BUCKET_CFG = SHAPES["mlp 16-24-4 x3"]  # weights of 1.5-2.3 KiB: a 0.002 MiB cap makes 3 buckets


@needs_process_group
def check_bucket_engine(cls: Callable[..., object], timeout_s: float | None = None) -> CheckResult:
    """`cls(model, cap_mb=...)` all-reduces gradient buckets from hooks, in bucket order, asynchronously and without
    waiting before backward ends; `.finish()` waits,
    leaves the averaged gradients in `.grad` and returns the number of all-reduces; it works step after step,
    and also when gradients arrive out of bucket order (differently on each rank)."""
    b = _BucketEngine(cls)
    equal_name = "equal to one process, step after step"
    return run_check("bucket engine", [
        Property(equal_name, b.equal,
                 "divide by world_size, copy each bucket back into its .grad, reset the counters in finish()"),
        Property("buckets start during backward", b.in_backward,
                 "launch in _ready, as soon as the next bucket in order has all its gradients, with async_op=True; "
                 "wait for the handles in finish()", needs=(equal_name,)),
        Property("buckets launched in order, whatever order gradients arrive in", b.in_order,
                 "in _ready, launch only self.next, and keep going while the next one is complete too (while, not if): "
                 "never whichever bucket is ready, or the ranks' collectives stop matching",
                 needs=(equal_name, "buckets start during backward")),
        Property("one all-reduce per bucket, counted", b.per_bucket,
                 "one flat tensor per bucket; finish() returns how many it waited for and empties its lists",
                 needs=(equal_name,)),
    ], timeout_s)


class _BucketEngine:
    """The setup (the learner's class, this rank), the training run every property reads, and one method per
    property's evidence."""

    def __init__(self, cls: Callable[..., object]) -> None:
        self.cls = cls
        self.rank, self.ws = _rank_ws()

    def steps(self, n: int, cap_mb: float = 0.002, make=lambda: ToyModel(**_BUCKET_CFG),
              classes: int = _BUCKET_CFG["out_dim"], swap: bool = False) -> tuple:
        model, ref = _model(make), _model(make)
        if swap:
            model.swap = self.rank % 2 == 1  # the same numbers, the gradients of a and b in the other order
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        engine = self.cls(model, cap_mb=cap_mb)
        launched, counts, first = [], [], None
        for step in range(n):
            x, y = _batch(step, in_dim=16, classes=classes)
            for o in (opt, ref_opt):
                o.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            before, waited = len(collectives()), waits()
            x_mine, y_mine = shard_batch(x, self.rank, self.ws), shard_batch(y, self.rank, self.ws)
            F.cross_entropy(model(x_mine), y_mine).backward()
            launched.append((collectives()[before:], blocking()[before:], waits() - waited))
            local = _grads(model)  # the buckets are reduced in copies: still this rank's own (only for a hint)
            counts.append((engine.finish(), len(collectives()) - before))  # (reported, issued in the step)
            if first is None:
                first = (_grads(model), _grads(ref), local)
            opt.step()
            ref_opt.step()
        return _params(model), _params(ref), launched, counts, first

    def equal(self) -> float:
        got, want, _, _, (g1, w1, local) = self.steps(3)
        _explain_grads(g1, w1, local, self.ws)  # the first step's gradients name the usual mistakes
        try:
            return max_diff(got, want, what="after 3 steps: ")
        except Mismatch as e:
            raise Mismatch(f"step 1 is right, a later step is not ({e}): the next step starts from the state the "
                           "last one left (pending counts, next bucket, lists)", e.diff) from None

    def in_backward(self) -> None:
        _, _, launched, _, _ = self.steps(2)
        if not all(calls for calls, _, _ in launched):
            raise Mismatch("no bucket was launched during backward: launch from the hook once a bucket is complete")
        blocked = sum(sum(b) for _, b, _ in launched)
        if blocked:
            raise Mismatch(f"{blocked} bucket all-reduce(s) issued during backward blocked until done (no "
                           "async_op=True): backward waited for each bucket, so nothing overlapped")
        waited = sum(w for _, _, w in launched)
        if waited:
            raise Mismatch(f"{waited} wait() call(s) during backward: a bucket's handle waited for as soon as it is "
                           "launched stalls backward until its all-reduce is done, so nothing overlaps; keep the "
                           "handles and wait in finish()")

    def in_order(self) -> float:
        why = ("gradients arrive in bucket order on rank 0 and out of it on rank 1 (a's bucket completes before b's): "
               "each rank must still launch the buckets in the same order, each once")
        try:
            got, want, launched, _, _ = self.steps(2, cap_mb=TWO_BRANCH_CAP_MB, make=_TwoBranch, swap=True)
        except CollectiveMismatch as e:
            if e.secondary:
                raise
            raise Mismatch(f"{why}; instead: {e}") from None
        missing = [k + 1 for k, (calls, _, _) in enumerate(launched) if len(calls) != 3]
        if missing:
            raise Mismatch(f"{why}; step {missing[0]}: {len(launched[missing[0] - 1][0])} of 3 buckets launched "
                           "during backward")
        return max_diff(got, want, what=f"{why}; after 2 steps: ")

    def per_bucket(self) -> None:
        _, _, launched, counts, _ = self.steps(2)
        one_bucket = self.steps(1, cap_mb=64.0)[3]
        reported, issued = zip(*counts)
        if reported != issued or not 1 < issued[0] < 2 * (_BUCKET_CFG["depth"] + 1) or one_bucket != [(1, 1)]:
            kept = " (step 2 counted step 1's handles too: empty the lists in finish())" \
                if reported[1:] == (2 * issued[0],) else ""
            raise Mismatch(f"finish() returned {list(reported)}, all-reduces issued per step {list(issued)} "
                           f"(expected one per bucket, 3 here; one bucket at a 64 MiB cap: {one_bucket}){kept}")
