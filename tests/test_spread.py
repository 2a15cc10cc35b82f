"""Verdicts drawn from several steps: medians with their spread, and no verdict inside the spread."""
from __future__ import annotations

import pytest

from ddp_lib.bench.spread import MIN_SAMPLES, Spread, compare, verdict
from ddp_lib.kit.spans import comm_compute_split, exposed_breakdown, minus


def test_spread_median_quartiles_and_extremes() -> None:
    s = Spread.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.q1, s.q3, s.lo, s.hi, s.n) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    assert s.scaled(2).median == 1.5 and s.scaled(2).n == 5
    with pytest.raises(ValueError):
        Spread.of([])


def test_compare_needs_ranges_apart() -> None:
    a = Spread.of([100, 101, 102, 103, 104])
    assert compare(a, Spread.of([90, 91, 92, 93, 94])) == "lower"
    assert compare(a, Spread.of([110, 111, 112, 113, 114])) == "higher"
    # medians differ by 1 %, the ranges overlap: the one-step "cheaper" of lesson 06 is no verdict
    assert compare(a, Spread.of([99, 100, 101, 102, 103])) == "within the spread"
    assert compare(a, Spread.of([99, 100, 101, 102, 103, 104, 140])) == "within the spread"
    one = Spread.of([90.0])
    assert compare(a, one) == "too few samples" and MIN_SAMPLES == 5


def test_verdict_sentence_says_which_and_never_picks_a_side_inside_the_spread() -> None:
    a = Spread.of([100, 101, 102, 103, 104])
    assert verdict(a, Spread.of([80, 81, 82, 83, 84]), "cheaper", "dearer").endswith(": cheaper")
    assert verdict(a, Spread.of([120, 121, 122, 123, 124]), "cheaper", "dearer").endswith(": dearer")
    inside = verdict(a, Spread.of([100.5, 101, 101.5, 102, 103]), "cheaper", "dearer")
    assert "inside the spread" in inside and "cheaper" not in inside and "dearer" not in inside
    assert "102.0 -> 101.5" in inside


def test_minus_removes_covered_time() -> None:
    assert minus([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert minus([(0, 10)], [(-5, 20)]) == []
    assert minus([(0, 2), (4, 6)], []) == [(0, 2), (4, 6)]
    assert minus([(0, 4)], [(3, 8)]) == [(0, 3)]


def test_exposed_breakdown_places_each_exposed_microsecond_once() -> None:
    # one 10 ms step: compute 0-4 ms; the launch call 4-5 ms; gloo's collective 4-9 ms; the engine's wait 6-10 ms
    spans = [("ProfilerStep#1", 0, 10_000), ("aten::mm", 0, 4_000), ("c10d::allreduce_", 4_000, 5_000),
             ("gloo:all_reduce", 4_000, 9_000), ("ddp.wait", 6_000, 10_000), ("train.backward", 0, 6_000)]
    b = exposed_breakdown(spans, [(0, 10_000)])
    assert b == pytest.approx({"in_wait_ms": 3.0, "launching_ms": 1.0, "between_ops_ms": 1.0, "idle_wait_ms": 1.0})
    exposed = comm_compute_split(spans, [(0, 10_000)])["exposed_ms"]
    assert b["in_wait_ms"] + b["launching_ms"] + b["between_ops_ms"] == pytest.approx(exposed)
    assert exposed_breakdown([(n, a, b) for n, a, b in spans if n != "ddp.wait"], [(0, 10_000)]) is None


def test_per_window_split_equals_the_split_of_each_window_alone():
    import random

    from ddp_lib.kit.spans import comm_compute_per_window

    rng = random.Random(0)
    names = ["aten::mm", "gloo:all_reduce", "ddp.wait", "ProfilerStep#1", "nccl:all_gather", "aten::add_"]
    spans = []
    for _ in range(400):
        a = rng.uniform(0, 1000)
        spans.append((rng.choice(names), a, a + rng.uniform(0, 40)))
    windows = [(0.0, 180.0), (180.0, 410.5), (500.0, 760.0), (760.0, 1040.0)]
    per = comm_compute_per_window(spans, windows)
    assert per == [pytest.approx(comm_compute_split(spans, [w])) for w in windows]
    assert any(p["hidden_ms"] > 0 for p in per) and any(p["exposed_ms"] > 0 for p in per)  # both kinds exercised
    assert comm_compute_per_window(spans, []) == []


def test_split_figures_of_a_synthetic_profile_whole_and_per_step():
    # two 10 ms steps; compute covers 0-5 ms and 10.5-11 ms, collectives 4-12 ms (one crossing the step boundary)
    # and 15-16 ms; labels (the step ranges, the engine's wait) are not work
    spans = [("ProfilerStep#1", 0, 10_000), ("aten::mm", 0, 4_000), ("aten::add_", 3_000, 5_000),
             ("gloo:all_reduce", 4_000, 9_000), ("nccl:all_gather", 8_000, 12_000), ("ddp.wait", 9_000, 10_000),
             ("ProfilerStep#2", 10_000, 20_000), ("aten::mm", 10_500, 11_000), ("gloo:all_reduce", 15_000, 16_000),
             ("aten::mm", 21_000, 22_000)]  # outside every step: not counted
    windows = [(0, 10_000), (10_000, 20_000)]
    whole = {"comm_ms": 4.5, "compute_ms": 2.75, "hidden_ms": 0.75, "exposed_ms": 3.75}  # per step, over both
    per_step = [{"comm_ms": 6.0, "compute_ms": 5.0, "hidden_ms": 1.0, "exposed_ms": 5.0},
                {"comm_ms": 3.0, "compute_ms": 0.5, "hidden_ms": 0.5, "exposed_ms": 2.5}]
    assert comm_compute_split(spans, windows) == whole
    assert [comm_compute_split(spans, [w]) for w in windows] == per_step
    from ddp_lib.kit.spans import comm_compute_split_and_per_window

    assert comm_compute_split_and_per_window(spans, windows) == (whole, per_step)  # one merge, the same figures
    assert comm_compute_split_and_per_window(spans, []) == (comm_compute_split(spans, []), [])
