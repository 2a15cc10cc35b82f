"""The simulation's dry mode (DDP_GPU_SIM_DRY=1, ddp_lib.gpusim._dry) on a simulated 2xT4: large tensors hold no data
but count exactly against the card, an allocation past a T4 raises CUDA's OutOfMemoryError naming the card, NCCL still
refuses CPU tensors, collectives still meet on every rank (a rank that skips one leaves the other to time out), and
values read on the host are the documented placeholders (a host storage copied from a dry one too).

Run as a script, this file is the simulated process itself (`python tests/test_gpusim_dry.py`, with ddp_lib imported
first); pytest runs it once in a subprocess with DDP_GPU_SIM=2xT4 DDP_GPU_SIM_DRY=1.
"""

from __future__ import annotations

import ast
import datetime
import shutil
from pathlib import Path

import pytest

from sim_box import ROOT, sim_result

# starts the simulated GPU box, which needs torch's CPU build: skipped with the reason on a CUDA build
pytestmark = pytest.mark.gpusim

MiB = 2**20


def _err(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the error is the result
        return f"{type(e).__name__}: {e}"
    return None


def in_process() -> dict:
    """Single-process checks on cuda:0 of the dry 2xT4."""
    import torch

    out: dict = {}
    before = torch.cuda.memory_allocated()
    big = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    out["big_no_data"] = big._inner.is_meta
    out["counted"] = torch.cuda.memory_allocated() - before
    view = big[: 64 * MiB]  # a view shares the storage: counted once
    out["view_counted"] = torch.cuda.memory_allocated() - before
    del big, view
    out["freed"] = torch.cuda.memory_allocated() - before
    small = torch.arange(4.0, device="cuda")
    out["small_computes"] = (small * 2).tolist()
    lin = torch.nn.Linear(1024, 1024).cuda()  # 4 MiB of weight: dry; 4 KiB of bias: real
    x = torch.randn(32, 1024, device="cuda")
    loss = lin(x).square().mean()
    loss.backward()
    out["weight_dry"], out["bias_dry"] = lin.weight._inner.is_meta, lin.bias._inner.is_meta
    out["loss_item"] = loss.item()
    w = lin.weight.detach()
    out["allclose"] = torch.allclose(w, w + 1)  # placeholders: comparisons read True
    out["host_copy"] = float(w.cpu().abs().sum())
    out["str"] = str(w.sum())
    # a product of small real factors whose result is large (a weight's gradient from a small batch) is not computed
    a, b = torch.ones(4, 2048, device="cuda"), torch.ones(4, 2048, device="cuda")  # 32 KiB each
    outer, inner = a.t() @ b, a @ b.t()  # 16 MiB, and 4x4
    out["products"] = (outer._inner.is_meta, list(outer.shape), inner[0, 0].item())
    # torch.distributed.checkpoint's async stager copies each tensor's storage into host memory (lesson 08's async_save)
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager

    staged = StateDictStager().stage({"w": w})["w"]
    out["staged"] = (staged.device.type, list(staged.shape), bool(staged.eq(0).all()))
    dirty = torch.full((128, 128), float("nan"))  # 64 KiB of the host heap, freed: the next such allocation reuses it
    del dirty
    out["host_empty_zero"] = bool(w.new_empty((128, 128), device="cpu").eq(0).all())  # how the stager allocates
    torch.cuda.reset_peak_memory_stats()
    out["oom"] = _err(lambda: torch.empty(16 * 2**30, dtype=torch.uint8, device="cuda"))
    keep = [torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda") for _ in range(3)]  # 12 GiB: fits a T4
    out["oom_fourth"] = _err(lambda: keep.append(torch.zeros(4 * 2**30, dtype=torch.uint8, device="cuda")))
    out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del keep
    return out


def on_ranks() -> dict:
    """Each rank: a dry all-reduce met by both, NCCL refusing a CPU tensor, and a collective rank 1 skips."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    out: dict = {}
    t = torch.ones(1024, 1024, device=device)  # 4 MiB: dry
    dist.all_reduce(t)
    out["met"] = t._inner.is_meta
    out["cpu_refused"] = _err(lambda: dist.all_reduce(torch.ones(4)))
    g = torch.empty(2 * 1024 * 1024, device=device)
    dist.all_gather_into_tensor(g, t.view(-1))
    out["gather_shape"] = list(g.shape)
    short = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=3))
    if rank == 0:  # rank 1 never joins this one: its partner's host goes on (NCCL's wait orders the stream), then
        # its synchronize waits for the collective and fails at the group's timeout
        out["desync"] = _err(lambda: (dist.all_reduce(t, group=short), torch.cuda.synchronize()))
    else:
        out["desync"] = None
    dist.barrier()
    out["sweep"] = sweep_with_the_link_off(rank)
    return out


def lesson05_sweep_cells() -> tuple[list[float], str, str]:
    """Lesson 05's bucket caps at its real sizes (its parameters cell), its sweep cell, and its α–β model cell (on
    rank 0: without its `%%rank [0]` line)."""
    import re

    import nbformat

    nb = nbformat.read(next((ROOT / "notebooks").glob("05_*.ipynb")), as_version=4)
    src = {c.get("id"): c.source for c in nb.cells}
    caps = ast.literal_eval(re.search(r"SWEEP_MB = \[.*?\] if SMALL else (\[.*?\])", src["c02"])[1])
    assert src["c33"].startswith("%%rank [0]\n")
    return caps, src["c30"], src["c33"].split("\n", 1)[1]


def sweep_with_the_link_off(rank: int) -> dict:
    """Each rank: lesson 05's sweep cell and model cell as a GPU box runs them (LINK off, its real caps), dry, on a
    model whose gradients the caps split differently (mlp-wide: 52 MiB in 4 MiB weights), with no saved fit for
    nccl x2 (lesson 01 never ran here): the cell must measure one in place."""
    import tempfile

    import torch
    import torch.distributed as dist

    from ddp_lib.bench import ddp_rank_bench, fit_here
    from ddp_lib.bench.allreduce import link_label
    from ddp_lib.bench.race import format_race_short
    from ddp_lib.course import results
    from ddp_lib.gpusim import _dry

    caps, sweep_cell, model_cell = lesson05_sweep_cells()
    tmp = Path(tempfile.mkdtemp(prefix="dry05-"))
    fit = tmp / "alphabeta_fit.json"  # absent: what lesson 05 finds on a box where lesson 01 never ran
    rest = fit_here.fit_or_measure.__defaults__[2:]
    fit_here.fit_or_measure.__defaults__ = ((fit, fit_here.REFERENCE_FIT), fit, *rest)  # the cell's own call finds none
    results.RUNS = tmp
    kw = dict(bucket_mb=25.0, steps=1, warmup=0, rounds=1)
    ns = dict(LINK=None, MODEL="mlp-wide", SWEEP_MB=caps, BUCKET_MB=25.0, kw=kw, rank=rank, world_size=2, dist=dist,
              torch=torch, ddp_rank_bench=ddp_rank_bench, format_race_short=format_race_short, results=results,
              link_label=link_label, largest=1024 * 1024 * 4)
    largest, zeros = [0], _dry.zeros  # the largest host copy of a dry tensor (`.cpu()`) the race and the cells make

    def watched(t):
        largest[0] = max(largest[0], t.numel() * t.element_size())
        return zeros(t)
    _dry.zeros = watched
    try:
        ns["rows"] = ddp_rank_bench("mlp-wide", ["bucketed"], allocator_warmup=False, **kw)  # the race's bucketed row
        exec(sweep_cell, ns)  # noqa: S102 - the lesson's own cell
        if rank == 0:
            exec(model_cell, ns)  # noqa: S102
    finally:
        _dry.zeros = zeros
        shutil.rmtree(tmp, ignore_errors=True)
    record = ns["fit_record"]
    sweep = ns.get("sweep", [])  # rank 0's (the model cell runs there)
    return {"caps": [r["bucket_mb"] for r in sweep], "calls": [r["comm_calls"] for r in sweep],
            "fit": (record["backend"], record["world_size"], record["measured_here_s"] is not None),
            "real_caps": caps, "host_copy": largest[0], "param_diff": [r["param_diff"] for r in ns["rows_sweep"]]}


def main() -> None:
    """Print one dict: the single-process checks and both ranks' results."""
    from ddp_lib.launch import spawn

    result = {"process": in_process(), "ranks": spawn(on_ranks, 2, args=(), backend="nccl", timeout_s=200)}
    print("RESULT", repr(result), flush=True)


@pytest.fixture(scope="module")
def dry() -> dict:
    """Run the checks once on a dry simulated 2xT4."""
    code = "import ddp_lib, test_gpusim_dry; test_gpusim_dry.main()"  # ddp_lib first: the sim, then torch
    return sim_result(code, timeout_s=300, dry=True)


def test_large_tensors_hold_no_data_and_count_exactly(dry):
    p = dry["process"]
    assert p["big_no_data"] is True
    assert p["counted"] == p["view_counted"] == 256 * MiB
    assert p["freed"] == 0


def test_small_tensors_compute_and_large_ones_read_as_placeholders(dry):
    p = dry["process"]
    assert p["small_computes"] == [0.0, 2.0, 4.0, 6.0]
    assert (p["weight_dry"], p["bias_dry"]) == (True, False)
    assert p["loss_item"] == 0.0 and p["host_copy"] == 0.0 and p["allclose"] is True
    assert p["str"].startswith("tensor(0., device='cuda:0'")


def test_a_large_product_of_small_factors_is_not_computed_and_a_small_one_is(dry):
    assert dry["process"]["products"] == (True, [2048, 2048], 2048.0)


def test_a_host_copy_of_a_dry_storage_is_the_placeholder(dry):
    assert dry["process"]["staged"] == ("cpu", [1024, 1024], True)
    assert dry["process"]["host_empty_zero"] is True  # not the freed memory it reused


def test_an_allocation_past_a_t4_raises_out_of_memory_naming_the_card(dry):
    p = dry["process"]
    assert p["oom"].startswith("OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 GiB")
    assert "Tesla T4" in p["oom"]
    # three 4 GiB tensors fit the T4's 14.56 GiB; a fourth does not
    assert p["oom_fourth"] is not None and "Tesla T4" in p["oom_fourth"] and 12.0 <= p["peak_gib"] < 12.1  # and the small model above


def test_nccl_refuses_a_cpu_tensor_in_dry_mode(dry):
    assert [r["cpu_refused"] for r in dry["ranks"]] == [
        "RuntimeError: No backend type associated with device type cpu"] * 2


def test_collectives_meet_on_every_rank_and_a_skipped_one_still_fails(dry):
    r0, r1 = dry["ranks"]
    assert r0["met"] and r1["met"] and r0["gather_shape"] == [2 * 1024 * 1024]
    assert r0["desync"] is not None and r1["desync"] is None
    assert "timed out" in r0["desync"].lower() or "timeout" in r0["desync"].lower(), r0["desync"]


def test_lesson05s_sweep_with_the_link_off_races_every_real_cap_and_measures_a_missing_fit(dry):
    r0, r1 = (r["sweep"] for r in dry["ranks"])
    # the race's 25 MiB row and the sweep's other caps: more than one row, each cap splitting the gradients its own way
    assert r0["caps"] == sorted(set(r0["real_caps"]) | {25.0}) and len(r0["caps"]) > 1
    assert r0["calls"] == sorted(r0["calls"], reverse=True) and r0["calls"][0] > r0["calls"][-1]
    assert r0["fit"] == r1["fit"] == ("nccl", 2, True)  # no fit for nccl x2 saved: measured here, on both ranks


def test_lesson05s_race_checks_its_variants_without_a_host_copy_of_the_model(dry):
    for r in (r["sweep"] for r in dry["ranks"]):
        assert r["param_diff"][1:] == [0.0] * (len(r["param_diff"]) - 1)  # every variant checked against the first
        assert r["host_copy"] <= MiB  # placeholders of small results only: mlp-wide's 52 MiB never reach the host


if __name__ == "__main__":
    main()
