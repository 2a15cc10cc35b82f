"""The GPU path on real GPUs: every engine and ZeRO-1 against single-process training on NCCL, bf16 autocast,
the profiler's CUDA kernel table, the benchmarks, an NCCL hang. Marked `gpu`; skipped, with the reason,
where there are too few GPUs (`make gpu-check` runs them on a GPU box; `pytest -m gpu` selects them)."""

from __future__ import annotations

import math
import time

import pytest
import torch

import gpu_cases as G
from ddp_lib.ddp import ENGINES
from ddp_lib.launch import RankError, spawn

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.gpu
one_gpu = pytest.mark.skipif(N_GPUS < 1, reason=f"needs a CUDA GPU; this machine has {N_GPUS}")
two_gpus = pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2 CUDA GPUs (NCCL, one per rank); this machine has {N_GPUS}")

CASES = (
    [(e, m, None, 1) for e in ENGINES if e != "bucketed" for m in ("frozen", "tied")]
    + [("bucketed", m, mb, 1) for m in ("frozen", "tied") for mb in (1e-9, 1e-3, 25.0)]
    + [(e, "frozen", 25.0 if e == "bucketed" else None, 4) for e in ENGINES]  # no_sync accumulation
)


def _close(got: dict, want: dict, atol: float, rtol: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=rtol, msg=lambda m: f"{k}: {m}")


def _check_matrix(results: list[dict], atol: float, rtol: float) -> None:
    for r in results:
        for (engine, model, _, _), got in r["cases"].items():
            want_state, want_losses = r["refs"][model]
            assert got["device"].startswith("cuda")
            _close(got["state"], want_state, atol, rtol)
            assert got["losses"] == pytest.approx(want_losses, abs=atol, rel=rtol), (engine, model)
    for case in results[0]["cases"]:  # the same averaged gradients: the replicas end bit-identical
        a, b = results[0]["cases"][case]["state"], results[1]["cases"][case]["state"]
        assert all(torch.equal(a[k], b[k]) for k in a), case


@two_gpus
def test_every_engine_matches_single_process_training_on_nccl():
    _check_matrix(spawn(G.engine_matrix, world_size=2, args=(CASES,), backend="nccl", timeout_s=300), 1e-5, 1.3e-6)


@two_gpus
def test_fsdp_matches_single_process_training_on_nccl():
    for rank, r in enumerate(spawn(G.fsdp_vs_reference, world_size=2, backend="nccl", timeout_s=300)):
        assert r["devices"] == [f"cuda:{rank}"], r["devices"]  # the shards live on the rank's own GPU
        _close(r["got"], r["want"], 1e-5, 1.3e-6)


@two_gpus
def test_every_engine_under_bf16_autocast():
    # bf16 products round differently for a half batch and the whole one: bf16-level tolerance
    cases = [(e, "frozen", 1e-3 if e == "bucketed" else None, a) for e in ENGINES for a in (1, 2)]
    _check_matrix(spawn(G.engine_matrix, world_size=2, args=(cases, True), backend="nccl", timeout_s=300),
                  2e-2, 2e-2)


@two_gpus
def test_zero1_matches_adamw_on_nccl():
    for r in spawn(G.zero1_vs_adamw, world_size=2, backend="nccl", timeout_s=300):
        for got, want in zip(r["sharded"], r["plain"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1.3e-6)


@two_gpus
def test_profiler_kernel_table_shows_the_nccl_all_reduce():
    for r in spawn(G.profile_on_gpu, world_size=2, backend="nccl", timeout_s=300):
        assert r["device"] == "cuda"
        assert any("nccl" in k.lower() for k in r["kernels"]), r["kernels"]
        assert "nccl" in r["kernel_table"].lower() and "CUDA" in r["kernel_table"]
        assert 0 < r["comm_ms"] <= r["step_ms"] and r["compute_ms"] > 0


@two_gpus
def test_benchmarks_on_nccl_one_variant_alive_at_a_time():
    for r in spawn(G.benches_on_gpu, world_size=2, backend="nccl", timeout_s=300):
        rows = {row["variant"]: row for row in r["ddp"]}
        assert {row["backend"] for row in r["ddp"]} == {"nccl"}
        assert all(row["param_diff"] <= 1e-5 for v, row in rows.items() if v != "nocomm")
        variant_mb = [row["peak_mem_mb"] for v, row in rows.items() if v != "nocomm"]
        assert min(variant_mb) > 50  # at least the model copy (52 MB of fp32 MLP parameters) and its gradients
        # base model + one variant at its peak (+ slack for NCCL/cuBLAS): not the 7 variants at once
        assert r["race_peak_mb"] < 2 * max(variant_mb) + 128, (r["race_peak_mb"], variant_mb)
        assert r["left_mb"] < 64, "the race must free every variant it built (one is over 100 MB)"
        assert rows["torch"]["comm_calls"] >= 1 and rows["flat"]["comm_calls"] == 1
        assert [a["backend"] for a in r["allreduce"]] == ["nccl"] * 3
        assert all(a["busbw_GBps"] > 0 for a in r["allreduce"])
        # the race timed its steps with TF32 matmuls: its MFU is against the card's TF32 peak from sm_80 on
        tf32 = torch.cuda.get_device_capability(0)[0] >= 8
        peak_what = rows["naive"]["peak_what"]
        assert ("tf32" in peak_what) == tf32 or "no datasheet peak" in peak_what, peak_what


@two_gpus
@pytest.mark.parametrize("engine", ["simple", "bucketed"])
def test_train_mrpc_with_bf16_autocast(engine):
    from ddp_lib.apps.mfu import bf16_native

    r = spawn(G.train_mrpc_bf16, world_size=2, args=(engine,), backend="nccl", timeout_s=600)[0]
    # autocast where the GPU has bf16 tensor cores (sm_80 and up); a T4 (sm_75) trains in fp32, rightly
    assert r["bf16"] is bf16_native("cuda:0")[0] and r["device"] == "cuda:0" and r["ddp"] == engine
    assert len(r["losses"]) == 4 and all(math.isfinite(x) for x in r["losses"])


@two_gpus
def test_an_nccl_hang_ends_within_the_timeout_naming_the_collective(capfd):
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        spawn(G.skip_a_collective, world_size=2, args=(10.0,), backend="nccl", timeout_s=120)
    took = time.monotonic() - t0
    text = str(err.value) + capfd.readouterr().err
    assert "OpType=ALLREDUCE" in text  # torch's watchdog names the collective that timed out
    assert took < 60, f"the hang lasted {took:.0f} s with a 10 s timeout"


@one_gpu
def test_seed_check_and_engines_on_one_gpu():
    # the seed check once all-reduced a CPU tensor, which NCCL refuses
    cases = [(e, "frozen", None if e != "bucketed" else 25.0, 1) for e in ENGINES]
    r = spawn(G.engine_matrix, world_size=1, args=(cases,), backend="nccl", timeout_s=300)[0]
    for case, got in r["cases"].items():
        _close(got["state"], r["refs"]["frozen"][0], 1e-5, 1.3e-6)


@one_gpu
def test_profiler_kernel_table_on_one_gpu():
    r = spawn(G.profile_on_gpu, world_size=1, backend="nccl", timeout_s=300)[0]
    assert r["device"] == "cuda" and r["kernels"] and "CUDA" in r["kernel_table"]


@one_gpu
def test_backend_choice_on_this_machine():
    from ddp_lib.devices import pick_backend
    from ddp_lib.notebook._devices import plan_devices, visible_gpus

    assert pick_backend(1) == "nccl" and pick_backend(N_GPUS + 1) == "gloo"
    assert plan_devices(N_GPUS, None, False, visible_gpus()).gpu_ids == list(range(N_GPUS))
