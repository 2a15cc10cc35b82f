"""Lesson 06's checker, `check_exposed_comm`: planted mistakes fail the property they concern, with one diagnosis,
and right answers written another way pass; 2 gloo ranks in one spawned group."""

from __future__ import annotations

import pytest

from ddp_lib.launch import spawn
from ddp_lib.kit.profiling import comm_compute_split, is_comm

LIMIT_S = 20.0
LABELS = ("ProfilerStep", "train.", "ddp.")


def _union(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def solution(spans, windows):  # the lesson's solution
    comm, compute = [], []
    for name, start, end in spans:
        if name.startswith(LABELS):
            continue
        for s, t in windows:  # clip to each step
            a, b = max(start, s), min(end, t)
            if b > a:
                (comm if is_comm(name) else compute).append((a, b))
    comm, compute = _union(comm), _union(compute)
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    return (sum(b - a for a, b in comm) - hidden) / 1e3 / len(windows)


def sweep_line(spans, windows):  # right, another way: one pass over sorted boundaries, counters of what is active
    points = []
    for name, start, end in spans:
        if not name.startswith(LABELS) and end > start:
            kind = "comm" if is_comm(name) else "compute"
            points += [(start, kind, 1), (end, kind, -1)]
    for s, t in windows:
        points += [(s, "window", 1), (t, "window", -1)]
    points.sort(key=lambda p: p[0])
    active = {"comm": 0, "compute": 0, "window": 0}
    exposed, last = 0.0, None
    for x, kind, delta in points:
        if last is not None and active["window"] and active["comm"] and not active["compute"]:
            exposed += x - last
        active[kind] += delta
        last = x
    return exposed / 1000 / len(windows)


def package(spans, windows):  # right: the package's own split
    return comm_compute_split(spans, windows)["exposed_ms"]


def in_microseconds(spans, windows):
    return solution(spans, windows) * 1e3


def labels_as_compute(spans, windows):
    return solution([(f"aten::{n}" if n.startswith(LABELS) else n, a, b) for n, a, b in spans], windows)


def summed_durations(spans, windows):  # no union: two collectives in flight together count twice
    comm = [(max(a, s), min(b, t)) for n, a, b in spans if is_comm(n) and not n.startswith(LABELS)
            for s, t in windows if min(b, t) > max(a, s)]
    compute = _union([(max(a, s), min(b, t)) for n, a, b in spans if not is_comm(n) and not n.startswith(LABELS)
                      for s, t in windows if min(b, t) > max(a, s)])
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in _union(comm) for c, d in compute)
    return (sum(b - a for a, b in comm) - hidden) / 1e3 / len(windows)


def nested_compute_counted_twice(spans, windows):  # compute spans not merged: a nested op hides the same time twice
    comm, compute = [], []
    for name, start, end in spans:
        if name.startswith(LABELS):
            continue
        for s, t in windows:
            a, b = max(start, s), min(end, t)
            if b > a:
                (comm if is_comm(name) else compute).append((a, b))
    comm = _union(comm)
    hidden = sum(max(0.0, min(b, d) - max(a, c)) for a, b in comm for c, d in compute)
    return (sum(b - a for a, b in comm) - hidden) / 1e3 / len(windows)


def all_communication(spans, windows):  # what the profiler calls communication, hidden or not
    return comm_compute_split(spans, windows)["comm_ms"]


def not_clipped(spans, windows):
    return solution(spans, [(min(s for s, _ in windows) - 1e9, max(t for _, t in windows) + 1e9)]) / len(windows)


def not_per_step(spans, windows):
    return solution(spans, windows) * len(windows)


def stub(spans, windows):
    raise NotImplementedError


VARIANTS = {"solution": solution, "sweep_line": sweep_line, "package": package, "in_microseconds": in_microseconds,
            "labels_as_compute": labels_as_compute, "summed_durations": summed_durations,
            "nested_compute_counted_twice": nested_compute_counted_twice, "all_communication": all_communication,
            "not_clipped": not_clipped, "not_per_step": not_per_step, "stub": stub}


def _run_all() -> dict[str, list[tuple[str, str]]]:
    from ddp_lib.check.exposed_comm import check_exposed_comm

    return {name: [(r.name, r.status) for r in check_exposed_comm(fn, timeout_s=LIMIT_S, quiet=True).rows]
            for name, fn in VARIANTS.items()}


@pytest.fixture(scope="module")
def verdicts():
    results = spawn(_run_all, world_size=2, timeout_s=300)
    assert results[0] == results[1], "the ranks disagree on a verdict"
    return results[0]


@pytest.mark.parametrize("name", ["solution", "sweep_line", "package"])
def test_right_answers_pass(verdicts, name):
    assert all(status == "PASS" for _, status in verdicts[name]), verdicts[name]


@pytest.mark.parametrize("name,prop", [
    ("in_microseconds", "one all-reduce, in ms"),
    ("labels_as_compute", "labels are not work"),
    ("summed_durations", "overlapping collectives count once"),
    ("nested_compute_counted_twice", "compute hides communication"),
    ("all_communication", "compute hides communication"),
    ("not_clipped", "clipped to the steps, per step"),
    ("not_per_step", "clipped to the steps, per step"),
])
def test_each_mistake_fails_its_property_only(verdicts, name, prop):
    rows = dict(verdicts[name])
    failed = [p for p, status in rows.items() if status == "FAIL"]
    assert failed == [prop], rows
    assert rows["agrees with profile_steps on a real profile"] == "not checked", rows


def test_a_stub_reads_not_written_yet(verdicts):
    rows = dict(verdicts["stub"])
    assert rows["one all-reduce, in ms"] == "not written yet", rows
    assert all(s == "not checked" for p, s in rows.items() if p != "one all-reduce, in ms"), rows


def test_aten_ops_are_compute_even_when_named_like_a_collective():
    from ddp_lib.kit.spans import comm_compute_split, is_comm

    assert not is_comm("aten::broadcast_tensors")  # F.mse_loss calls it: a local op
    assert all(is_comm(n) for n in ("gloo:all_reduce", "c10d::allreduce_", "nccl:all_reduce", "c10d::broadcast_",
                                    "ncclDevKernel_AllReduce_Sum_f32_RING_LL"))
    split = comm_compute_split([("aten::broadcast_tensors", 0.0, 30.0), ("aten::mm", 0.0, 100.0)], [(0.0, 100.0)])
    assert split["comm_ms"] == 0 and split["hidden_ms"] == 0

