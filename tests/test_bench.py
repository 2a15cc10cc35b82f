"""ddp_lib.bench in smoke mode: columns, algbw/busbw definitions, the α–β fit, and that all variants agree."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch.distributed as dist

from ddp_lib.bench import (AlphaBeta, allreduce_rank_bench, best_bucket_bytes, ddp_rank_bench, exposed_comm_s,
                           fit_alpha_beta)
from ddp_lib.bench.__main__ import main, parse_size
from ddp_lib.launch import spawn

DDP_COLUMNS = {"variant", "step_ms", "min_step_ms", "comm_ms", "finish_ms", "exposed_comm_ms", "total_comm_ms",
               "hidden_frac", "comm_calls", "peak_mem_mb", "param_diff", "model", "world_size", "backend"}
AR_COLUMNS = {"size_bytes", "world_size", "backend", "time_us", "algbw_GBps", "busbw_GBps"}
VARIANTS = ["naive", "flat", "overlap", "bucketed", "bucketed:0.001", "torch", "torch-view"]


def both_benchmarks(out_dir: str) -> dict:
    """Rank side: tiny all-reduce and DDP benchmarks, then the allreduce CLI on this group (as under torchrun)."""
    ar = allreduce_rank_bench([4096, 16384, 65536], iters=3, warmup=1)
    ddp = ddp_rank_bench("toy", VARIANTS, bucket_mb=25.0, steps=3, warmup=1, predict=True)
    main(["allreduce", "--smoke", "--json", f"{out_dir}/ar.json"])
    return {"allreduce": ar, "ddp": ddp, "world_size": dist.get_world_size()}


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def results(out_dir):
    return spawn(both_benchmarks, world_size=2, args=(str(out_dir),), timeout_s=120, threads=1)


def test_every_rank_returns_the_same_rows(results):
    assert [r["variant"] for r in results[0]["ddp"]] == [r["variant"] for r in results[1]["ddp"]]
    assert [r["time_us"] for r in results[0]["allreduce"]] == [r["time_us"] for r in results[1]["allreduce"]]


def test_allreduce_columns_and_bandwidth_definitions(results):
    rows = results[0]["allreduce"]
    assert [r["size_bytes"] for r in rows] == [4096, 16384, 65536]
    for r in rows:
        assert AR_COLUMNS <= r.keys()
        n = r["world_size"]
        assert n == 2 and r["backend"] == "gloo" and r["time_us"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (n - 1) / n)


def test_ddp_rows_and_all_variants_agree(results):
    rows = results[0]["ddp"]
    assert [r["variant"] for r in rows] == ["nocomm"] + VARIANTS
    by = {r["variant"]: r for r in rows}
    for r in rows:
        assert DDP_COLUMNS <= r.keys()
        assert r["step_ms"] >= r["min_step_ms"] > 0
        if r["variant"] != "nocomm":
            assert r["param_diff"] <= 1e-5, r["variant"]  # same seed, same data: the same final parameters
    n_tensors = 6  # ToyModel: 3 linears
    assert by["naive"]["comm_calls"] == by["overlap"]["comm_calls"] == n_tensors
    assert by["flat"]["comm_calls"] == by["bucketed"]["comm_calls"] == by["torch"]["comm_calls"] == 1
    assert by["bucketed:0.001"]["comm_calls"] == n_tensors  # every tensor is larger than the cap
    assert by["nocomm"]["comm_calls"] == 0 and by["nocomm"]["exposed_comm_ms"] == 0
    assert by["torch"]["finish_ms"] is None and by["torch"]["comm_ms"] == by["torch"]["exposed_comm_ms"]
    assert by["flat"]["comm_ms"] == by["flat"]["finish_ms"]
    for r in rows[1:]:
        assert r["exposed_comm_ms"] == pytest.approx(max(0.0, r["step_ms"] - by["nocomm"]["step_ms"]))
        assert 0.0 <= r["hidden_frac"] <= 1.0
        assert r["predicted_best_bucket_mb"] > 0
    assert by["bucketed:0.001"]["predicted_exposed_ms"] >= 0


def test_alpha_beta_fit_never_reports_a_negative_latency():
    """Large sizes only, with noise that tilts the free fit below zero: α is fixed at 0 and flagged."""
    sizes = [2**20 * k for k in (1, 2, 4, 8)]
    times = [0.9e-3, 2.0e-3, 4.1e-3, 8.0e-3]  # T ≈ n / 1 GB/s, the smallest point a little fast
    fit = fit_alpha_beta(sizes=sizes, times_s=times)
    assert fit.alpha_s == 0.0 and not fit.alpha_resolved
    assert fit.bandwidth_GBps == pytest.approx(1.05, rel=0.05)
    exact = fit_alpha_beta(sizes=sizes, times_s=[30e-6 + n / 1e9 for n in sizes])
    assert exact.alpha_resolved and exact.alpha_us == pytest.approx(30.0, rel=1e-6)


def test_alpha_beta_fit_recovers_synthetic_data():
    alpha, beta = 25e-6, 1 / 12e9  # 25 µs, 12 GB/s
    sizes = [2**k for k in range(10, 31, 2)]
    for relative in (True, False):
        fit = fit_alpha_beta(sizes=sizes, times_s=[alpha + beta * n for n in sizes], relative=relative)
        assert fit.alpha_us == pytest.approx(25.0, rel=1e-6)
        assert fit.bandwidth_GBps == pytest.approx(12.0, rel=1e-6)
    rows = [{"size_bytes": n, "time_us": (alpha + beta * n) * 1e6} for n in sizes]
    assert fit_alpha_beta(rows).alpha_us == pytest.approx(25.0, rel=1e-6)
    with pytest.raises(ValueError):
        fit_alpha_beta(sizes=[1, 1], times_s=[1.0, 2.0])


def test_bucket_model():
    model, total, backward = AlphaBeta(alpha_s=1e-3, beta_s_per_byte=1e-9), 100e6, 0.5  # 1 ms, 1 GB/s, 500 ms
    # compute-bound buckets: only the last bucket is exposed; one bucket: everything is exposed
    assert exposed_comm_s(total, model, total, backward) == pytest.approx(model.time_s(total))
    assert exposed_comm_s(10e6, model, total, backward) == pytest.approx(model.time_s(10e6))
    # tiny buckets: latency-bound, k·α dominates
    assert exposed_comm_s(1e3, model, total, backward) > exposed_comm_s(10e6, model, total, backward)
    best = best_bucket_bytes(model, total, backward)
    grid = [total / k for k in range(1, 2000)]
    assert exposed_comm_s(best, model, total, backward) <= min(exposed_comm_s(b, model, total, backward) for b in grid) + 1e-12
    # closed form in the communication-bound regime: b* = N·sqrt(α/B)
    slow = AlphaBeta(alpha_s=1e-3, beta_s_per_byte=2e-9)  # N·β = 200 ms > B = 100 ms: comm-bound everywhere
    b = best_bucket_bytes(slow, total, 0.1)
    assert b == pytest.approx(total * math.sqrt(1e-3 / 0.1), rel=0.05)


def test_parse_size():
    assert parse_size("64KB") == 65536 and parse_size("1GB") == 2**30 and parse_size("4096") == 4096


def test_cli_ddp_smoke_writes_json_csv_plot(tmp_path, capsys):
    path = tmp_path / "ddp.json"
    main(["ddp", "--smoke", "--variants", "naive,flat,bucketed,torch", "--json", str(path)])
    rows = json.loads(path.read_text())
    assert [r["variant"] for r in rows] == ["nocomm", "naive", "flat", "bucketed", "torch"]
    with (tmp_path / "ddp.csv").open() as f:
        header = next(csv.reader(f))
    assert {"variant", "step_ms", "comm_ms", "comm_calls", "hidden_frac"} <= set(header)
    assert (tmp_path / "ddp.png").stat().st_size > 0
    assert "agree (atol 1e-5): yes" in capsys.readouterr().out


def test_cli_allreduce_on_an_existing_group_writes_json_csv_plot(results, out_dir):
    rows = json.loads((out_dir / "ar.json").read_text())  # written by rank 0 inside the spawned group
    assert {r["size_bytes"] for r in rows} == {4096, 16384, 65536}
    with (out_dir / "ar.csv").open() as f:
        assert AR_COLUMNS <= set(next(csv.reader(f)))
    assert (out_dir / "ar.png").stat().st_size > 0
