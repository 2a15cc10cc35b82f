"""α per call beside pipelined α (issue 59): lesson 01's benchmark puts a barrier and a device synchronize around
every call, so a fixed cost paid once per synchronize (launching, waiting for the device, the ranks lining up) lands
in every call's α; nccl-tests launches the calls back to back and synchronizes once, so that cost is shared by all of
them. Lessons 04 and 05 predict calls issued back to back, so they take the pipelined α where it was saved.

The two methods are run on 2 gloo ranks under a fake clock (deterministic, no timing bound): every all-reduce of n
bytes advances it by A + n·B, every synchronize by S. Per call the fit must find α = A + S; pipelined, A + S/iters.
"""

from __future__ import annotations

import json
import types

import pytest

from ddp_lib.bench.alphabeta import fit_alpha_beta, fit_by_group, fit_interval, load_fit, save_fits, save_pipelined_fit
from ddp_lib.launch import spawn

A, B, S = 30e-6, 1e-9, 2e-3  # s per call, s per byte, s per synchronize
SIZES = [4096 * 4**i for i in range(5)]
ITERS = 20


def _both_methods() -> tuple[list[dict], list[dict]]:
    from ddp_lib import comm
    from ddp_lib.bench import allreduce

    now = [0.0]

    def all_reduce(tensor, *args, **kwargs):
        now[0] += A + tensor.numel() * tensor.element_size() * B
        return comm.all_reduce(tensor, *args, **kwargs)

    def start(device):
        comm.barrier()
        return now[0]

    def stop(device, t0):
        now[0] += S  # the synchronize: paid once per stop, whatever was queued before it
        return now[0] - t0

    saved = allreduce.comm, allreduce.start_clock, allreduce.stop_clock
    allreduce.comm = types.SimpleNamespace(all_reduce=all_reduce, barrier=comm.barrier)
    allreduce.start_clock, allreduce.stop_clock = start, stop
    try:
        per_call = allreduce.allreduce_rank_bench(SIZES, iters=5, warmup=1, budget_s=1e9)
        pipelined = allreduce.allreduce_pipelined_rank_bench(SIZES, iters=ITERS, warmup=1, repeats=2, budget_s=1e9)
    finally:
        allreduce.comm, allreduce.start_clock, allreduce.stop_clock = saved
    return per_call, pipelined


@pytest.fixture(scope="module")
def rows():
    return spawn(_both_methods, world_size=2, backend="gloo", timeout_s=180, threads=1)[0]


def test_per_call_alpha_counts_the_synchronize_once_per_call_pipelined_once_per_run(rows):
    per_call, pipelined = rows
    assert all(r["method"] == "pipelined" and r["iters"] == ITERS for r in pipelined)
    for r in per_call:
        assert r["time_us"] == pytest.approx((A + S + r["size_bytes"] * B) * 1e6)
    for r in pipelined:
        assert r["time_us"] == pytest.approx((A + S / ITERS + r["size_bytes"] * B) * 1e6)
    fit_call, fit_pipe = fit_by_group(per_call)[("gloo", 2)], fit_by_group(pipelined)[("gloo", 2)]
    assert fit_call.alpha_s == pytest.approx(A + S, rel=1e-6)
    assert fit_pipe.alpha_s == pytest.approx(A + S / ITERS, rel=1e-6)
    assert fit_call.beta_s_per_byte == pytest.approx(B, rel=1e-6) == fit_pipe.beta_s_per_byte


def _rows(alpha_s: float, ws: int = 2) -> list[dict]:
    return [dict(backend="nccl", world_size=ws, size_bytes=n, time_us=(alpha_s + n * B) * 1e6) for n in SIZES]


def test_lessons_04_05_read_the_pipelined_alpha_where_saved_else_the_per_call_one(tmp_path):
    path = tmp_path / "fit.json"
    save_fits(_rows(50e-6), path, machine="box")
    fit, rec = load_fit("nccl", 2, [path], pipelined=True)  # nothing pipelined saved yet: the per-call α, said so
    assert fit.alpha_us == pytest.approx(50.0) and rec["alpha_method"] == "per call (no pipelined fit saved)"
    save_pipelined_fit(_rows(8e-6), path)
    fit, rec = load_fit("nccl", 2, [path], pipelined=True)
    assert fit.alpha_us == pytest.approx(8.0) and rec["alpha_method"] == "pipelined"
    # the record is the pipelined fit's: its points, so an interval drawn from them surrounds the α printed beside it
    assert rec["alpha_s"] == pytest.approx(8e-6) and "interval" not in rec
    assert fit_alpha_beta(rec["rows"]).alpha_us == pytest.approx(8.0)
    lo, hi = fit_interval(rec["rows"])["alpha_us"]
    assert lo <= 8.0 + 1e-6 and hi >= 8.0 - 1e-6
    fit, rec = load_fit("nccl", 2, [path])  # lesson 01 and everything else: the per-call fit, unchanged
    assert fit.alpha_us == pytest.approx(50.0) and rec["alpha_method"] == "per call"
    # lesson 01's 4-rank session refits every group from the rows of both sessions: x2's pipelined fit stays
    save_fits(_rows(50e-6) + _rows(90e-6, ws=4), path, machine="box")
    assert load_fit("nccl", 2, [path], pipelined=True)[1]["alpha_method"] == "pipelined"
    assert "pipelined" not in next(f for f in json.loads(path.read_text())["fits"] if f["world_size"] == 4)
    save_fits(_rows(60e-6), path, machine="another box")  # another machine's per-call fit: the old pipelined one goes
    assert load_fit("nccl", 2, [path], pipelined=True)[1]["alpha_method"] == "per call (no pipelined fit saved)"


def _measure_here(path: str) -> list:
    from pathlib import Path

    from ddp_lib.bench.fit_here import describe, fit_or_measure

    missing = Path(path).with_name("never-written.json")
    first = fit_or_measure(paths=[missing, path], save_to=path, sizes=SIZES[:3], iters=3, pipelined=True)[1]
    second = fit_or_measure(paths=[missing, path], save_to=path, pipelined=True)[1]
    # each record holds the points of the α it describes: refitting them gives that α back
    same = [fit_alpha_beta(r["rows"]).alpha_s == pytest.approx(r["alpha_s"]) for r in (first, second)]
    return [first["alpha_method"], second["alpha_method"], second["measured_here_s"], describe(second), same]


def test_a_fit_measured_in_place_measures_the_pipelined_alpha_too(tmp_path):
    path = tmp_path / "fit.json"
    first, second, second_s, line, same = spawn(_measure_here, world_size=2, args=(str(path),), backend="gloo",
                                          timeout_s=180, threads=1)[0]
    assert first == second == "pipelined" and second_s is None and line.endswith("alpha pipelined")
    assert same == [True, True]
    assert "pipelined" in json.loads(path.read_text())["fits"][0]
