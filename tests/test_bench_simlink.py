"""The simulated link: collectives complete no sooner than α + bytes/bandwidth, one after another, results exact."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from ddp_lib.bench.ddp_step import ddp_rank_bench
from ddp_lib.bench.simlink import SimulatedLink
from ddp_lib.launch import spawn


def test_schedule_is_one_lane_alpha_plus_bytes_over_bandwidth():
    link = SimulatedLink(alpha_us=1000, bandwidth_GBps=1.0)  # 1 ms + 1 ns per byte
    assert link.cost_s(10**6) == pytest.approx(0.002)
    assert link.schedule(0.0, 10**6) == pytest.approx(0.002)
    assert link.schedule(0.001, 10**6) == pytest.approx(0.004), "issued while the link is busy: queued"
    assert link.schedule(0.010, 0) == pytest.approx(0.011), "issued on an idle link: starts at once"
    with pytest.raises(ValueError):
        SimulatedLink(alpha_us=1, bandwidth_GBps=0)


def link_case() -> dict:
    """Two async all-reduces and a blocking one under a 60 ms link: when each completes, and what it holds."""
    rank = dist.get_rank()
    a, b = torch.full((4,), rank + 1.0), torch.full((4,), 10.0 * (rank + 1))
    real = dist.all_reduce
    with SimulatedLink(alpha_us=60_000, bandwidth_GBps=100.0) as link:
        patched = dist.all_reduce is not real
        t0 = time.perf_counter()
        wa, wb = dist.all_reduce(a, async_op=True), dist.all_reduce(b, async_op=True)
        early = wa.is_completed() or wb.is_completed()
        wa.wait()
        t_a = time.perf_counter() - t0
        wb.wait()
        t_b = time.perf_counter() - t0
        cpu0 = time.process_time()
        t1 = time.perf_counter()
        dist.all_reduce(a)  # blocking, on an idle link
        t_c, cpu_c = time.perf_counter() - t1, time.process_time() - cpu0
    return {"patched": patched, "restored": dist.all_reduce is real, "early": early, "t_a": t_a, "t_b": t_b,
            "t_c": t_c, "cpu_c": cpu_c, "a": a.tolist(), "b": b.tolist(), "label": link.label}


def test_link_holds_completions_back_and_keeps_results():
    for r in spawn(link_case, world_size=2, backend="gloo", timeout_s=120, threads=1):
        assert r["patched"] and r["restored"]
        assert not r["early"], "a collective is not complete before the link delivered it"
        assert r["t_a"] >= 0.060 and r["t_b"] >= 0.120, "the second waits for the first: one lane"
        assert r["t_c"] >= 0.060 and r["cpu_c"] < 0.5 * r["t_c"], "the wait is a sleep, not CPU"
        assert r["a"] == [6.0] * 4 and r["b"] == [30.0] * 4  # (1+2) summed twice; 10+20
        assert "60000 µs" in r["label"]


def race_case() -> list[dict]:
    return ddp_rank_bench("toy", ["naive", "bucketed", "torch-view"], steps=2, warmup=1, link=(2000.0, 1.0))


def test_race_under_the_link_agrees_and_is_labelled():
    rows = spawn(race_case, world_size=2, backend="gloo", timeout_s=180, threads=1)[0]
    by = {r["variant"]: r for r in rows}
    for v in ("naive", "bucketed", "torch-view"):
        assert by[v]["param_diff"] <= 1e-5 and by[v]["link"].startswith("simulated link")
        assert by[v]["total_comm_ms"] >= 2.0 * by[v]["comm_calls"], "every call pays the link's α"
    assert by["torch-view"]["comm_calls"] == 1  # its buckets, seen by the link's comm hook
