"""ddp_lib.bench: bandwidths and spreads against hand-computed numbers, the α–β fit on synthetic data, the
overlap columns on made-up rows, and in smoke mode on 2 gloo ranks: columns, warm-up per size, agreement."""

from __future__ import annotations

import contextlib
import csv
import json
import math

import pytest
import torch
import torch.distributed as dist

from ddp_lib.bench import (AlphaBeta, allreduce_rank_bench, best_bucket_bytes, ddp_rank_bench, exposed_comm_s,
                           fit_alpha_beta)
from ddp_lib.bench.__main__ import main, parse_size
from ddp_lib.bench.allreduce import bandwidths, spread
from ddp_lib.bench.alphabeta import REFERENCE_FIT, load_fit, residuals, save_fits
from ddp_lib.comm import spy_on
from ddp_lib.bench.overlap_probe import reduced_by_backward_end
from ddp_lib.bench.race import format_race, overlap_columns
from ddp_lib.bench.throughput import CPU_NO_PEAK, throughput_columns
from ddp_lib.launch import spawn

DDP_COLUMNS = {"variant", "step_ms", "min_step_ms", "p25_step_ms", "p75_step_ms", "comm_ms", "finish_ms",
               "exposed_comm_ms", "total_comm_ms", "comm_calls", "peak_mem_mb", "param_diff", "model", "world_size", "backend"}
AR_COLUMNS = {"size_bytes", "world_size", "backend", "time_us", "p25_time_us", "p75_time_us", "min_time_us",
              "max_time_us", "mean_time_us", "iters", "algbw_GBps", "busbw_GBps"}
VARIANTS = ["naive", "flat", "overlap", "bucketed", "bucketed-pergrad", "bucketed:0.001", "torch", "torch-view"]


def both_benchmarks(out_dir: str) -> dict:
    """Rank side: tiny all-reduce (float32 calls counted per size) and DDP benchmarks, then the allreduce CLI."""
    calls: dict[int, int] = {}

    def counting(tensor, *args, **kwargs):
        if tensor.dtype.is_floating_point and tensor.element_size() == 4:  # not slowest_rank's float64 MAX
            calls[tensor.numel()] = calls.get(tensor.numel(), 0) + 1

    with spy_on("all_reduce", counting):
        ar = allreduce_rank_bench([4096, 16384, 65536], iters=4, warmup=2)
    ddp = ddp_rank_bench("toy", VARIANTS, bucket_mb=25.0, steps=3, warmup=1, predict=True)
    shares = reduced_by_backward_end("toy", VARIANTS, steps=2, warmup=1)
    main(["allreduce", "--smoke", "--json", f"{out_dir}/ar.json", "--fit-json", f"{out_dir}/fit.json"])
    return {"allreduce": ar, "ddp": ddp, "calls": calls, "shares": shares, "interleaved": interleaved_race()}


INTERLEAVED = ["bucketed", "torch-view"]


def interleaved_race() -> dict:
    """Rank side: the interleaved race, with every step it takes recorded in order as (variant, timed)."""
    from ddp_lib.bench import ddp_step

    seen, real = [], ddp_step.VariantRun.step

    def step(self, batch, timed=True):
        seen.append((self.variant, timed))
        return real(self, batch, timed)

    ddp_step.VariantRun.step = step
    try:  # the race above warmed the allocator up in this process already
        rows = ddp_rank_bench("toy", INTERLEAVED, bucket_mb=25.0, steps=3, warmup=1, interleave=True,
                              allocator_warmup=False)
    finally:
        ddp_step.VariantRun.step = real
    return {"rows": rows, "seen": seen}


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def results(out_dir):
    return spawn(both_benchmarks, world_size=2, args=(str(out_dir),), backend="gloo", timeout_s=120, threads=1)


def test_bandwidths_hand_computed():
    assert bandwidths(1e9, 0.5, 4) == pytest.approx((2.0, 3.0))  # 1 GB in 0.5 s; busbw x 2(4-1)/4 = 1.5
    assert bandwidths(4096, 1e-3, 2) == pytest.approx((0.004096, 0.004096))  # 2 ranks: busbw = algbw
    assert bandwidths(2**20, 1e-3, 8) == pytest.approx((1.048576, 1.835008))  # x 1.75


def test_spread_hand_computed():
    s = spread([4e-3, 1e-3, 3e-3, 2e-3, 5e-3])
    assert s == pytest.approx(dict(time_us=3000, p25_time_us=2000, p75_time_us=4000, min_time_us=1000,
                                   max_time_us=5000, mean_time_us=3000))
    skewed = spread([1e-3, 1e-3, 1e-3, 9e-3])  # one slow call: the median ignores it, the mean does not
    assert skewed["time_us"] == pytest.approx(1000) and skewed["mean_time_us"] == pytest.approx(3000)
    assert spread([2e-3]) == pytest.approx(dict(time_us=2000, p25_time_us=2000, p75_time_us=2000,
                                                min_time_us=2000, max_time_us=2000, mean_time_us=2000))


def test_allreduce_rows_warm_up_every_size(results):
    rows = results[0]["allreduce"]
    assert [r["size_bytes"] for r in rows] == [4096, 16384, 65536]
    for r in rows:
        assert AR_COLUMNS <= r.keys() and r["world_size"] == 2 and r["backend"] == "gloo" and r["iters"] == 4
        assert 0 < r["min_time_us"] <= r["p25_time_us"] <= r["time_us"] <= r["p75_time_us"] <= r["max_time_us"]
    for res in results:  # one-element calls to warm the group up, then per size 2 warm-up + 4 timed calls
        calls = dict(res["calls"])
        assert calls.pop(1) >= 2 and calls == {1024: 6, 4096: 6, 16384: 6}


def test_ddp_rows_and_all_variants_agree(results):
    rows = results[0]["ddp"]
    assert [r["variant"] for r in rows] == ["nocomm"] + VARIANTS
    by = {r["variant"]: r for r in rows}
    for r in rows:
        assert DDP_COLUMNS <= r.keys()
        assert r["p75_step_ms"] >= r["step_ms"] >= r["p25_step_ms"] >= r["min_step_ms"] > 0
        assert "hidden_frac" not in r  # the indirect estimate is gone: the probe's hidden_share replaces it
        if r["variant"] != "nocomm":
            assert r["param_diff"] <= 1e-5, r["variant"]  # same seed, same data: the same final parameters
    n_tensors = 6  # ToyModel: 3 linears
    assert by["naive"]["comm_calls"] == by["overlap"]["comm_calls"] == n_tensors
    assert by["flat"]["comm_calls"] == by["bucketed"]["comm_calls"] == by["torch"]["comm_calls"] == 1
    assert by["bucketed-pergrad"]["comm_calls"] == 1  # the same engine hooked per gradient: the same plan
    # 1 kB cap: each bias (smaller) waits in its bucket for the weight after it, which closes it: 3 buckets
    assert by["bucketed:0.001"]["comm_calls"] == 3
    assert by["nocomm"]["comm_calls"] == 0 and by["torch"]["finish_ms"] is None
    # toy: Linear 32->64, 64->64, head 64->8, 32 samples per rank: forward 2·b·in·out per layer, backward as much for
    # the weight gradients plus the input gradients of every layer but the first (the data needs none)
    b, mm = 32, [32 * 64, 64 * 64, 64 * 8]
    per_rank = 2 * b * sum(mm) * 2 + 2 * b * sum(mm[1:])
    for r in rows:
        assert r["samples_per_step"] == 64 and r["tokens_per_step"] is None and r["flops_per_step"] == 2 * per_rank
        assert r["peak_flops"] is None and r["peak_what"] == CPU_NO_PEAK  # CPU ranks: no datasheet peak


def test_probe_shares(results):
    shares = results[0]["shares"]
    assert shares["naive"] == shares["flat"] == 0.0  # blocking, after backward: nothing reduced by its end
    assert shares["bucketed-pergrad"] is not None  # BucketedDDP hooked per gradient: the probe sees it too
    assert shares["torch"] is None and shares["torch-view"] is None  # the C++ reducer is not visible to the spy
    for v in ("overlap", "bucketed", "bucketed:0.001"):
        assert 0.0 <= shares[v] <= 1.0, v


def test_overlap_columns_hand_computed():
    rows = [dict(variant="nocomm", bwd_ms=50.0, finish_ms=None, total_comm_ms=0.0),
            dict(variant="naive", bwd_ms=50.0, finish_ms=40.0, total_comm_ms=38.0),  # all after backward
            dict(variant="bucketed", bwd_ms=70.0, finish_ms=10.0, total_comm_ms=40.0),
            dict(variant="torch", bwd_ms=90.0, finish_ms=None, total_comm_ms=40.0)]
    shares = {"naive": 0.0, "bucketed": 0.75, "torch": None}
    by = {r["variant"]: r for r in overlap_columns(rows, shares)}
    assert by["naive"]["hidden_share"] == 0.0 and by["naive"]["bwd_extra_ms"] == 0.0
    assert by["bucketed"]["hidden_ms"] == 30.0 and by["bucketed"]["hidden_share"] == 0.75  # 3/4 of 40 ms
    assert by["bucketed"]["bwd_extra_ms"] == 20.0  # backward got slower while communication ran beside it
    assert by["torch"]["hidden_share"] is None and by["torch"]["bwd_extra_ms"] is None
    assert by["nocomm"]["hidden_share"] is None
    assert overlap_columns(rows)[2]["hidden_share"] is None  # no probe, no number
    for r in rows:
        r.update(step_ms=100.0, min_step_ms=90.0, exposed_comm_ms=10.0, comm_calls=3)
    table = format_race(rows, shares)
    assert "75%" in table.splitlines()[3] and table.splitlines()[4].split()[6] == "-"


def test_throughput_columns_hand_computed():
    rows = [dict(variant="a", step_ms=100.0, world_size=2, tokens_per_step=4096, samples_per_step=32,
                 flops_per_step=6e12, peak_flops=100e12),
            dict(variant="b", step_ms=50.0, world_size=2, tokens_per_step=None, samples_per_step=32,
                 flops_per_step=1e9, peak_flops=None)]
    a, b = throughput_columns(rows)
    assert a["tokens_per_s"] == pytest.approx(40960) and a["samples_per_s"] == pytest.approx(320)
    assert a["mfu"] == pytest.approx(0.3)  # 6e12 FLOPs in 0.1 s = 60 TFLOP/s over 2 GPUs of 100
    assert b["tokens_per_s"] is None and b["samples_per_s"] == pytest.approx(640) and b["mfu"] is None


@pytest.mark.parametrize("name, capability, tf32, tflops", [
    ("NVIDIA A100-SXM4-40GB", (8, 0), True, 156.0), ("NVIDIA A100-SXM4-40GB", (8, 0), False, 19.5),
    ("NVIDIA H100 80GB HBM3", (9, 0), True, 494.5), ("Tesla T4", (7, 5), True, 8.1)])
def test_the_race_peak_is_tf32_where_it_is_on_and_the_card_has_it(monkeypatch, name, capability, tf32, tflops):
    from ddp_lib.bench.throughput import device_peak
    from ddp_lib.bench.timing import tf32_matmuls

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda", 0)
    with tf32_matmuls(cuda) if tf32 else contextlib.nullcontext():  # as the race sets it
        peak, what = device_peak(cuda)
    assert peak == pytest.approx(tflops * 1e12) and ("tf32" in what) == (tf32 and capability >= (8, 0))
    assert device_peak(torch.device("cpu")) == (None, CPU_NO_PEAK)


@pytest.mark.parametrize("peak", [100e12, None])
def test_race_table_shows_tokens_per_second_and_mfu_or_why_not(peak):
    what = "A100 tf32 dense datasheet peak, 156.0 TFLOP/s" if peak else CPU_NO_PEAK
    rows = [dict(variant=v, step_ms=ms, p25_step_ms=ms, p75_step_ms=ms, exposed_comm_ms=0.0, finish_ms=None,
                 total_comm_ms=0.0, bwd_ms=10.0, comm_calls=0, world_size=2, tokens_per_step=8192,
                 samples_per_step=8, flops_per_step=6e12, peak_flops=peak, peak_what=what)
            for v, ms in (("nocomm", 100.0), ("naive", 200.0))]
    lines = format_race(rows).splitlines()
    assert lines[0].split()[-3:] == ["tok/s", "MFU", "param_diff"]
    assert lines[1].split()[-3:] == ["81,920", "30.0%" if peak else "-", "-"]
    assert lines[2].split()[-3:-1] == ["40,960", "15.0%" if peak else "-"]
    assert lines[3:] == ([f"MFU against each rank's {what}"] if peak else [CPU_NO_PEAK])  # once, under the table


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


def test_alpha_beta_fit_recovers_noisy_synthetic_data():
    alpha, beta = 500e-6, 1 / 1.2e9  # 500 µs, 1.2 GB/s: a gloo-on-CPU-like link
    sizes = [4096 * 4**i for i in range(8)]  # 4 KiB .. 64 MiB, across the crossover α/β = 600 kB
    noise = [1.04, 0.97, 1.02, 0.96, 1.03, 0.98, 1.05, 0.97]
    fit = fit_alpha_beta(sizes=sizes, times_s=[(alpha + beta * n) * e for n, e in zip(sizes, noise)])
    assert fit.alpha_us == pytest.approx(500, rel=0.1) and fit.bandwidth_GBps == pytest.approx(1.2, rel=0.1)


def test_residuals_hand_computed():
    model = AlphaBeta(alpha_s=1e-3, beta_s_per_byte=1e-9)  # 1 ms + 1 ns/byte
    res = residuals(model, [{"size_bytes": 1e6, "time_us": 4000.0}, {"size_bytes": 0, "time_us": 500.0}])
    assert [r["size_bytes"] for r in res] == [0, 1e6]
    assert [r["predicted_us"] for r in res] == pytest.approx([1000.0, 2000.0])
    assert [r["ratio"] for r in res] == pytest.approx([0.5, 2.0])


def test_fits_saved_and_loaded_first_file_first(tmp_path):
    sizes = [4096 * 4**i for i in range(8)]
    rows = [dict(backend="gloo", world_size=ws, size_bytes=n, time_us=(a + n / 1e9) * 1e6)
            for ws, a in ((2, 500e-6), (4, 2e-3)) for n in sizes]
    path = save_fits(rows, tmp_path / "fit.json", machine="test box")
    fit4, rec4 = load_fit("gloo", 4, [tmp_path / "missing.json", path])  # a missing file is skipped
    assert fit4.alpha_us == pytest.approx(2000.0) and fit4.bandwidth_GBps == pytest.approx(1.0)
    assert rec4["machine"] == "test box" and rec4["straddles_crossover"] and len(rec4["rows"]) == 8
    assert rec4["crossover_bytes"] == pytest.approx(2e6)
    with pytest.raises(FileNotFoundError, match="lesson 01"):
        load_fit("nccl", 2, [path])


@pytest.mark.parametrize("slope", [0.0, -1e-12], ids=["flat", "falling"])
def test_a_fit_whose_times_do_not_grow_with_size_is_saved_without_a_crossover(tmp_path, slope):
    sizes = [4096, 16384, 65536]
    rows = [dict(backend="gloo", world_size=2, size_bytes=n, time_us=(300e-6 + slope * n) * 1e6) for n in sizes]
    path = save_fits(rows, tmp_path / "fit.json")
    fit, rec = load_fit("gloo", 2, [path])
    assert fit.beta_s_per_byte <= 0
    assert rec["crossover_bytes"] is None and rec["straddles_crossover"] is False


def test_committed_reference_fit_is_usable():
    fit, rec = load_fit("gloo", 2, [REFERENCE_FIT])
    assert fit.alpha_resolved and fit.alpha_s > 0 and rec["straddles_crossover"] and rec["machine"]


def test_bucket_model_hand_computed():
    model, total = AlphaBeta(alpha_s=1e-3, beta_s_per_byte=2e-9), 100e6  # 1 ms, 0.5 GB/s, 100 MB
    # 10 buckets of 10 MB: c = 1 ms + 20 ms; comm-bound: B/k + k·c - B = 10 + 210 - 100 ms
    assert exposed_comm_s(10e6, model, total, 0.1) == pytest.approx(0.120)
    # backward of 1 s: each bucket is reduced before the next is ready; only the last one's 21 ms is left
    assert exposed_comm_s(10e6, model, total, 1.0) == pytest.approx(0.021)


def test_parse_size():
    assert parse_size("64KB") == 65536 and parse_size("1GB") == 2**30 and parse_size("4096") == 4096


def test_cli_ddp_smoke_writes_json_csv_plot(tmp_path, capsys):
    path = tmp_path / "ddp.json"
    main(["ddp", "--smoke", "--variants", "naive,flat,bucketed,bucketed-pergrad,torch-view", "--rounds", "2", "--json",
          str(path)])
    rows = json.loads(path.read_text())
    assert [r["variant"] for r in rows] == ["nocomm", "naive", "flat", "bucketed", "bucketed-pergrad", "torch-view"]
    assert all(len(r["round_step_ms"]) == 2 and min(r["round_step_ms"]) > 0 for r in rows)  # one median per round
    with (tmp_path / "ddp.csv").open() as f:
        header = next(csv.reader(f))
    assert {"variant", "step_ms", "comm_ms", "comm_calls", "hidden_share"} <= set(header)
    assert (tmp_path / "ddp.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "agree (atol 1e-5): yes" in out
    head = next(line for line in out.splitlines() if line.startswith("variant"))
    assert "smp/s" in head.split() and "MFU" in head.split()  # the toy workload has no tokens: samples per second
    assert out.count(CPU_NO_PEAK) == 1 and all(r["samples_per_step"] > 0 for r in rows)
    assert "bucketed / torch-view round by round" in out and "of 2 rounds at or below 1.00" in out
    assert "bucketed-pergrad / torch-view round by round" in out and "bucketed / bucketed-pergrad round by" in out


def test_one_round_median_is_the_step_median(results):
    for r in results[0]["ddp"]:  # one round: its median is the median over every timed step
        assert r["round_step_ms"] == [pytest.approx(r["step_ms"])], r["variant"]


def test_interleaved_race_steps_the_variants_in_turn_and_each_step_is_a_round(results):
    order, warmup, steps = ["nocomm"] + INTERLEAVED, 1, 3
    raced = results[0]["interleaved"]["seen"][: len(order) * (warmup + steps)]  # torch DDP's message step comes after
    want = [(v, i >= warmup) for i in range(warmup + steps) for v in (order if i % 2 == 0 else order[::-1])]
    assert raced == want
    rows = results[0]["interleaved"]["rows"]
    assert [r["variant"] for r in rows] == order
    for r in rows:
        assert len(r["round_step_ms"]) == steps and r["peak_mem_mb"] is None, r
        assert sorted(r["round_step_ms"])[1] == pytest.approx(r["step_ms"])  # one step a round: its median is the step's
    assert all(r["param_diff"] <= 1e-5 for r in rows[1:])
    with pytest.raises(ValueError, match="leave rounds at 1"):
        ddp_rank_bench("toy", INTERLEAVED, rounds=2, interleave=True)


def test_round_ratios_pair_each_round():
    from ddp_lib.bench.race import format_round_ratios, headline, round_ratios

    rows = [dict(variant="nocomm", round_step_ms=[50.0, 70.0, 60.0]),
            dict(variant="bucketed", round_step_ms=[60.0, 80.0, 63.0]),
            dict(variant="torch-view", round_step_ms=[50.0, 100.0, 60.0])]
    assert round_ratios(rows) == pytest.approx([1.2, 0.8, 1.05])  # round by round, not pooled
    line = format_round_ratios(rows)
    assert "1.200 0.800 1.050" in line and "median 1.050" in line and "1 of 3 rounds at or below 1.00" in line
    assert round_ratios(rows, "bucketed", "torch") is None  # no such variant
    assert format_round_ratios([dict(r, round_step_ms=r["round_step_ms"][:1]) for r in rows]) is None  # 1 round
    full = [dict(r, step_ms=r["round_step_ms"][0], p25_step_ms=0, p75_step_ms=0, exposed_comm_ms=0, comm_calls=0,
                 bwd_ms=1.0) for r in rows]
    assert headline(full)["bucketed_over_torch_view_rounds"] == pytest.approx([1.2, 0.8, 1.05])
    assert "interval" not in line  # 3 rounds: too few to resample


def test_median_interval_is_a_point_for_equal_values_and_covers_the_median_of_scattered_ones():
    from ddp_lib.bench.race import format_round_ratios, median_interval

    assert median_interval([1.02] * 8) == (1.02, 1.02)
    scattered = [0.86, 0.91, 0.95, 0.97, 0.99, 1.01, 1.03, 1.06, 1.1, 1.16]
    lo, hi = median_interval(scattered)
    assert min(scattered) < lo < 1.0 < hi < max(scattered)  # the median 1.0 inside, narrower than the data
    assert median_interval(scattered) == (lo, hi)  # deterministic for a seed
    rows = [dict(variant="bucketed", round_step_ms=[10 * x for x in scattered]),
            dict(variant="torch-view", round_step_ms=[10.0] * len(scattered))]
    assert f"median 1.000 (90% bootstrap interval {lo:.3f}-{hi:.3f}), 5 of 10 rounds at or below 1.00" in \
        format_round_ratios(rows)


def test_cli_allreduce_on_an_existing_group_writes_json_csv_plot_fit(results, out_dir):
    rows = json.loads((out_dir / "ar.json").read_text())  # written by rank 0 inside the spawned group
    assert {r["size_bytes"] for r in rows} == {4096, 16384, 65536}
    fit, rec = load_fit("gloo", 2, [out_dir / "fit.json"])
    assert [r["size_bytes"] for r in rec["rows"]] == [4096, 16384, 65536]
    with (out_dir / "ar.csv").open() as f:
        assert AR_COLUMNS <= set(next(csv.reader(f)))
    assert (out_dir / "ar.png").stat().st_size > 0


def late_rank1_shares() -> dict:
    """Rank side: rank 1 starts each step's backward only once rank 0 has taken its end-of-backward reading (a store
    key per step, set from rank 0's `_synchronize`), so none of rank 0's all-reduces can have completed by then
    (they need rank 1's gradients): the probe must read 0 there, not the 1.0 it would read after the engines'
    end-of-backward wait. A handshake, not a sleep: a loaded machine cannot make rank 0's backward outlast it."""
    import dataclasses
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    import ddp_lib.bench.overlap_probe as probe
    from ddp_lib.ddp import BucketedDDP, OverlapDDP

    store, rank, step = c10d._get_default_store(), dist.get_rank(), [0]
    real_get, real_sync = probe.get_workload, {cls: cls._synchronize for cls in (OverlapDDP, BucketedDDP)}

    def marked_then_sync(cls):
        def _synchronize(self):
            store.set(f"late_rank1/marked{step[0]}", "1")  # the probe's reading for this step is already taken
            return real_sync[cls](self)
        return _synchronize

    def late(name):
        w = real_get(name)

        def loss(model, batch):
            step[0] += 1
            out = w.loss(model, batch)  # forward first: BucketedDDP's may broadcast its rebuilt bucket plan
            if rank == 1:
                store.wait([f"late_rank1/marked{step[0]}"], timedelta(seconds=60))
            return out

        return dataclasses.replace(w, loss=loss)

    probe.get_workload = late
    if rank == 0:
        for cls in real_sync:
            cls._synchronize = marked_then_sync(cls)
    try:
        return probe.reduced_by_backward_end("toy", ["overlap", "bucketed:0.001"], steps=2, warmup=1)
    finally:
        probe.get_workload = real_get
        for cls, fn in real_sync.items():
            cls._synchronize = fn


def test_hidden_share_is_read_when_backward_compute_ends_not_after_the_wait():
    shares = spawn(late_rank1_shares, world_size=2, backend="gloo", timeout_s=120, threads=1)[0]
    assert shares == {"overlap": 0.0, "bucketed:0.001": 0.0}


def test_allreduce_plot_survives_a_fit_with_negative_beta(tmp_path):
    """Three noisy small sizes (a --smoke run) can fit β < 0, so the model predicts a negative time at the
    largest size: the measured/model panel skips that point instead of handing matplotlib negative error bars
    (seen once in CI: "'yerr' must not contain negative values")."""
    from ddp_lib.bench.alphabeta import fit_by_group
    from ddp_lib.bench.plots import plot_allreduce

    rows = [dict(backend="gloo", world_size=2, size_bytes=s, time_us=t, p25_time_us=0.9 * t, p75_time_us=1.1 * t,
                 busbw_GBps=0.1) for s, t in ((4096, 65.9), (16384, 12.8), (65536, 396.8))]
    fit = fit_by_group(rows)[("gloo", 2)]
    assert fit.beta_s_per_byte < 0 and fit.time_s(65536) < 0
    plot_allreduce(rows, tmp_path / "ar.png")
    assert (tmp_path / "ar.png").stat().st_size > 0


def test_perfect_overlap_bound_is_forward_plus_max_of_backward_and_cheapest_comm():
    from ddp_lib.bench.race import format_race_short, headline, overlap_bound

    def row(variant, step, bwd, comm):
        return dict(variant=variant, step_ms=step, p25_step_ms=step, p75_step_ms=step, bwd_ms=bwd, total_comm_ms=comm,
                    exposed_comm_ms=None, finish_ms=None, comm_calls=1, param_diff=0.0)

    rows = [row("nocomm", 50.0, 30.0, 0.0), row("naive", 110.0, 30.0, 70.0), row("flat", 90.0, 30.0, 40.0),
            row("bucketed", 60.0, 40.0, 45.0)]
    b = overlap_bound(rows)  # forward+optimizer 20 ms; communication 40 ms (flat's) outlasts backward's 30 ms
    assert b["bound_ms"] == pytest.approx(60.0) and b["comm_ms"] == 40.0
    assert b["ratios"] == pytest.approx({"naive": 110 / 60, "flat": 1.5, "bucketed": 1.0})
    assert "perfect-overlap bound 60.0 ms" in format_race_short(rows, {}) and "bucketed 1.00" in format_race_short(rows, {})
    assert headline(rows)["overlap_bound_ms"] == pytest.approx(60.0)
    rows[2]["total_comm_ms"] = 10.0  # communication shorter than backward: the bound is nocomm's own step
    assert overlap_bound(rows)["bound_ms"] == pytest.approx(50.0)
    assert overlap_bound(rows[:1]) is None


def test_fit_interval_is_a_point_for_exact_data_and_covers_the_truth_for_scattered_data():
    from ddp_lib.bench.alphabeta import fit_interval, regime

    sizes = [2**k for k in range(12, 27)]
    exact = [dict(size_bytes=n, time_us=(300e-6 + n / 2e9) * 1e6) for n in sizes]
    iv = fit_interval(exact)
    assert iv["alpha_us"] == pytest.approx([300, 300]) and iv["bandwidth_GBps"] == pytest.approx([2.0, 2.0])
    assert iv["crossover_bytes"] == pytest.approx([600e3, 600e3])
    assert regime(4096, iv) == "latency-bound" and regime(2**24, iv) == "bandwidth-bound"
    noise = [1.8, 0.6, 1.3, 0.8, 1.1, 0.9, 1.25, 0.85, 1.05, 0.95, 1.2, 0.8, 1.1, 0.9, 1.0]  # up to 1.8x, as measured
    scattered = [dict(size_bytes=r["size_bytes"], time_us=r["time_us"] * f) for r, f in zip(exact, noise)]
    wide = fit_interval(scattered)
    lo, hi = wide["alpha_us"]
    assert lo < 300 < hi and hi - lo > 50  # the scatter shows as width, around the true α
    assert wide["crossover_bytes"][0] < 600e3 < wide["crossover_bytes"][1]
    assert regime(600e3, wide) == "near the crossover"
    assert fit_interval(scattered) == wide  # deterministic for a seed
    # timings that give no positive α (all zero, as a dry simulation reads them) have no crossover: said, not a crash
    flat = fit_interval([dict(size_bytes=n, time_us=0.0) for n in sizes])
    if None in flat["crossover_bytes"]:
        assert regime(4096, flat) == "no crossover resolved"
    assert regime(4096, {"crossover_bytes": [None, None]}) == "no crossover resolved"


def test_ring_extrapolation_and_scaling_hand_computed():
    from ddp_lib.bench.alphabeta import ring_allreduce_s, scaling

    ab = AlphaBeta(alpha_s=1e-3, beta_s_per_byte=1e-9)  # a 2-rank fit: 1 ms, 1 GB/s
    assert ring_allreduce_s(ab, 1e8, 2) == pytest.approx(1e-3 + 0.1)  # the fit itself at p = 2
    assert ring_allreduce_s(ab, 1e8, 8) == pytest.approx(7e-3 + 2 * 7 / 8 * 0.1)
    assert ring_allreduce_s(ab, 1e8, 1) == 0.0
    rows = scaling(ab, 1e8, 0.15, [2, 8])
    assert rows[0]["weak_exposed_s"] == 0.0 and rows[0]["strong_exposed_s"] == 0.0  # 101 ms hides in 150 ms
    assert rows[1]["weak_exposed_s"] == pytest.approx(0.182 - 0.15)  # 182 ms of comm against 150 ms of backward
    assert rows[1]["strong_backward_s"] == pytest.approx(0.0375)
    assert rows[1]["strong_efficiency"] == pytest.approx(0.0375 / 0.182)


def test_k_equal_buckets_are_scored_as_k_whatever_the_float_rounding():
    """total / (total / 29) is 29.000000000000004 in floats: still 29 buckets, not 30."""
    model, total = AlphaBeta(1e-3, 1e-9), 4_000_000.0
    assert total / (total / 29) > 29
    assert exposed_comm_s(total / 29, model, total, 0.02) == exposed_comm_s(total / 28.99, model, total, 0.02)
    # the optimum of the α-β model for 4,000,040 bytes, α = 1 ms, β = 1 ns/B, 20 ms of backward: 16 buckets
    # (E = 1.2500 ms; 15 give 1.2667 ms), which the rounding once scored as a tie with 15
    assert best_bucket_bytes(model, 4_000_040.0, 0.02) == 4_000_040.0 / 16



def test_fsdp_race_states_the_per_round_ratio_and_where_its_interval_lies():
    from ddp_lib.bench.fsdp_race import format_race
    from ddp_lib.bench.race import median_interval

    base = dict(depth=8, width=256, world_size=2, backend="gloo", steps=50, rounds=5, param_diff=0.0,
                course=dict(step_ms=9.0, p25_ms=8.0, p75_ms=10.0), torch=dict(step_ms=10.0, p25_ms=9.0, p75_ms=11.0),
                ratio=0.9)
    below = format_race(dict(base, round_ratios=[0.8, 0.85, 0.9, 0.92, 0.95]))
    lo, hi = median_interval([0.8, 0.85, 0.9, 0.92, 0.95])
    assert f"median 0.900, 90% bootstrap interval {lo:.3f}-{hi:.3f}: lies at or below 1.00" in below
    assert "includes 1.00" in format_race(dict(base, round_ratios=[0.8, 0.9, 1.0, 1.1, 1.2]))
    assert "lies above 1.00" in format_race(dict(base, round_ratios=[1.1, 1.2, 1.3, 1.25, 1.15]))
    assert "per round" not in format_race(dict(base, round_ratios=[0.9, 0.9, 0.9]))  # too few rounds to resample
