"""Checkers of lesson 05: the overlap hook (async all-reduce from a gradient hook) and the bucket plan."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib.check._runner import CheckResult, Mismatch, Property, collectives, max_diff, run_check
from ddp_lib.check.basics import SHAPES, _batch, _explain_grads, _grads, _model, _params, _rank_ws
from ddp_lib.data import shard_batch
from ddp_lib.ddp.bucketed import assign_buckets
from ddp_lib.models import ToyModel


def check_overlap_hook(cls: Callable[[nn.Module], object], timeout_s: float | None = None) -> CheckResult:
    """`cls(model)` registers gradient hooks that launch async all-reduces; `.finish()` waits and returns the count.

    After backward and `finish()` every gradient must be the average over ranks (equal to one process on the
    full batch, over 2 model shapes), the all-reduces must have been *launched during backward* (by the hooks,
    before `finish()` is called), and there must be one all-reduce per gradient, which `finish()` reports.
    """
    rank, ws = _rank_ws()

    def one_step(cfg: dict) -> tuple[dict, dict, dict, list[str], int]:
        model = _model(lambda: ToyModel(**cfg))
        x, y = _batch(0, in_dim=cfg["in_dim"], classes=cfg["out_dim"])
        ref = _model(lambda: ToyModel(**cfg))
        F.cross_entropy(ref(x), y).backward()
        engine = cls(model)
        before = len(collectives())
        F.cross_entropy(model(shard_batch(x, rank, ws)), shard_batch(y, rank, ws)).backward()
        local = _grads(model)  # with async all-reduces still in flight this may already be averaged: only a hint
        in_backward = collectives()[before:]
        count = engine.finish()
        return _grads(model), _grads(ref), local, in_backward, count

    def equal() -> float:
        worst = 0.0
        for cfg in SHAPES.values():
            got, want, local, _, _ = one_step(cfg)
            _explain_grads(got, want, local, ws)
            worst = max(worst, max_diff(got, want, what="grad of "))
        return worst

    def during_backward() -> None:
        _, _, _, launched, _ = one_step(SHAPES["mlp 16-32-4"])
        if not launched:
            raise Mismatch("no collective was issued during backward: the hook must launch the all-reduce")

    def one_per_gradient() -> None:
        cfg = SHAPES["mlp 16-24-4 x3"]
        n = 2 * (cfg["depth"] + 1)  # a weight and a bias per linear
        _, _, _, launched, count = one_step(cfg)
        if len(launched) != n:
            raise Mismatch(f"{len(launched)} collectives during backward for {n} gradients")
        if count != n:
            raise Mismatch(f"finish() returned {count!r}, but {n} all-reduces were launched")

    return run_check("overlap hook", [
        Property("equal to one process", equal, "divide by world_size, and wait for every handle before reading"),
        Property("collectives start during backward", during_backward,
                 "launch dist.all_reduce(p.grad, async_op=True) inside the hook, not in finish()"),
        Property("one all-reduce per gradient, counted", one_per_gradient,
                 "keep every handle; finish() waits for each and returns how many"),
    ], timeout_s)


def check_bucket_plan(fn: Callable[[list, int, int], list], timeout_s: float | None = None) -> CheckResult:
    """`fn(params, cap_bytes, first_cap_bytes)` groups `params` into buckets the way torch DDP does.

    Reverse parameter order; a bucket closes as soon as its bytes reach the cap in force (`first_cap_bytes` for
    the first bucket, `cap_bytes` after); a tensor larger than the cap is a bucket of its own; no collective.
    """
    def ids(groups: list) -> list[list[int]]:
        return [[id(p) for p in g] for g in groups]

    def compare(params: list, cap: int, first: int) -> None:
        got = fn(params, cap, first)
        want = assign_buckets(list(reversed(params)), cap, first)
        if ids(got) != ids(want):
            sizes = [[p.numel() * p.element_size() for p in g] for g in got]
            raise Mismatch(f"{len(got)} buckets of {sizes} bytes; expected {len(want)}: "
                           f"{[[p.numel() * p.element_size() for p in g] for g in want]}")
        if collectives():
            raise Mismatch(f"planning issued {collectives()}")

    def model_params(depth: int, width: int) -> list:
        torch.manual_seed(0)
        return list(ToyModel(width, width, 4, depth=depth).parameters())

    def same_plan() -> None:
        params = model_params(3, 32)  # weights 4 KiB, biases 128 B
        compare(params, 6000, 6000)
        compare(params, 9000, 9000)

    def small_first() -> None:
        compare(model_params(3, 32), 9000, 100)  # the first bucket: the head's bias alone

    def larger_than_cap() -> None:
        compare(model_params(2, 32), 1000, 1000)  # every weight over the cap: a bucket each

    return run_check("bucket plan", [
        Property("same plan as torch DDP's rule", same_plan,
                 "reverse parameter order; close a bucket once it reaches the cap (>=), after adding the tensor"),
        Property("small first bucket", small_first, "the first bucket closes at first_cap_bytes, the others at cap_bytes"),
        Property("a tensor over the cap is alone", larger_than_cap, "never split a tensor; close the bucket it fills"),
    ], timeout_s)


def check_bucket_engine(cls: Callable[..., object], timeout_s: float | None = None) -> CheckResult:
    """`cls(model, cap_mb=...)` all-reduces gradient buckets from hooks, in bucket order; `.finish()` waits,
    leaves the averaged gradients in `.grad` and returns the number of all-reduces; it works step after step."""
    rank, ws = _rank_ws()
    cfg = SHAPES["mlp 16-24-4 x3"]  # weights of 1.5-2.3 KiB: a 0.002 MiB cap makes 4 buckets (first: 1 MiB cap)

    def steps(n: int, cap_mb: float = 0.002) -> tuple[dict, dict, list[list[str]], list]:
        model, ref = _model(lambda: ToyModel(**cfg)), _model(lambda: ToyModel(**cfg))
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        engine = cls(model, cap_mb=cap_mb)
        launched, counts = [], []
        for step in range(n):
            x, y = _batch(step, in_dim=cfg["in_dim"], classes=cfg["out_dim"])
            for o in (opt, ref_opt):
                o.zero_grad()
            F.cross_entropy(ref(x), y).backward()
            before = len(collectives())
            F.cross_entropy(model(shard_batch(x, rank, ws)), shard_batch(y, rank, ws)).backward()
            launched.append(collectives()[before:])
            counts.append((engine.finish(), len(collectives()) - before))  # (reported, issued in the step)
            opt.step()
            ref_opt.step()
        return _params(model), _params(ref), launched, counts

    def equal() -> float:
        got, want, _, _ = steps(3)
        return max_diff(got, want, what="after 3 steps: ")

    def in_backward() -> None:
        _, _, launched, _ = steps(2)
        if not all(launched):
            raise Mismatch("no bucket was launched during backward: launch from the hook once a bucket is complete")

    def per_bucket() -> None:
        _, _, launched, counts = steps(2)
        one_bucket = steps(1, cap_mb=64.0)[3]
        reported, issued = zip(*counts)
        if reported != issued or not 1 < issued[0] < 2 * (cfg["depth"] + 1) or one_bucket != [(1, 1)]:
            raise Mismatch(f"finish() returned {list(reported)}, all-reduces issued per step {list(issued)} "
                           f"(expected one per bucket, 4 here; one bucket at a 64 MiB cap: {one_bucket})")

    return run_check("bucket engine", [
        Property("equal to one process, step after step", equal,
                 "divide by world_size, copy each bucket back into its .grad, reset the counters in finish()"),
        Property("buckets start during backward", in_backward,
                 "launch in _ready, as soon as the next bucket in order has all its gradients"),
        Property("one all-reduce per bucket, counted", per_bucket, "one flat tensor per bucket; count what you wait for"),
    ], timeout_s)
