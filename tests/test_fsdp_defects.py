"""Each FSDP defect found against torch's FSDP2, at 2 and 3 gloo ranks (rank code: fsdp_defect_cases)."""

from __future__ import annotations

import pytest
import torch

import fsdp_defect_cases as C
from ddp_lib.launch import spawn

WORLD_SIZES = [2, 3]


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def memory(request):
    return spawn(C.memory, world_size=request.param, backend="gloo", timeout_s=180)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def contract(request):
    return request.param, spawn(C.contract, world_size=request.param, backend="gloo", timeout_s=240)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def guards(request):
    return request.param, spawn(C.guards, world_size=request.param, backend="gloo", timeout_s=180)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda ws: f"ws{ws}")
def units(request):
    return spawn(C.units, world_size=request.param, backend="gloo", timeout_s=240)


def test_no_full_size_gradient_outlives_backward(memory):
    """Defect 1: one reduce-scatter in flight at most; none of their full-size inputs is alive after backward."""
    for rank in memory:
        gathered, rs_inputs = rank["mlp"]["after_backward"]
        assert rs_inputs == 0 and gathered == 0
        assert max(rs for kind, _, rs in rank["mlp"]["backward"]) <= C.LIVE_BOUND[1]
        assert max(ag for kind, ag, _ in rank["mlp"]["backward"] + rank["mlp"]["forward"]) <= C.LIVE_BOUND[0]


def test_frozen_layers_are_freed_in_backward(memory):
    """Defect 2: frozen layers re-gathered for backward are freed there too (4 frozen middle layers)."""
    for rank in memory:
        gathered, rs_inputs = rank["frozen"]["after_backward"]
        assert gathered == 0 and rs_inputs == 0 and rank["frozen"]["live_units"] == 0
        assert max(ag for kind, ag, _ in rank["frozen"]["backward"]) <= C.LIVE_BOUND[0]
        assert sum(kind == "all_gather" for kind, *_ in rank["frozen"]["backward"]) >= 4  # they were re-gathered


def test_forgotten_finish_still_trains_like_one_process(contract):
    """Defect 3: synchronization happens at the end of backward; finish only confirms."""
    _, ranks = contract
    assert all(r["no_finish_diff"] < 1e-5 for r in ranks)


def test_state_dict_is_the_full_model(contract):
    """Defects 4, 5: a plain model loads it with strict=True; rank 0's file loads on every rank, re-sharded."""
    _, ranks = contract
    for r in ranks:
        assert r["plain_from_state_dict"] < 1e-5
        assert r["loaded_full_diff"] < 1e-5


def test_sharded_checkpoint_one_file_per_rank(contract):
    ws, ranks = contract
    for r in ranks:
        assert r["loaded_sharded_diff"] == 0
        assert r["files"] == [f"shard-rank{k:05d}-of-{ws:05d}.pt" for k in range(ws)]
        assert "loads only with the world size that wrote it" in r["mismatch"]


def test_clip_grad_norm_equals_one_process(contract):
    """Defect 6: the total norm is the full gradient's, and clipped training equals one process clipping."""
    _, ranks = contract
    for r in ranks:
        mine, ref = r["clip_norms"]
        assert mine == pytest.approx(ref, rel=1e-5)
        assert all(n > 0.05 for n in ref)  # the clipping really acted
        assert r["clip_diff"] < 1e-5


def test_rewrap_detaches_the_old_wrapper(contract):
    """Defect 7: wrapping the same module again works and trains right; the old wrapper refuses clearly."""
    _, ranks = contract
    for r in ranks:
        assert r["rewrap_diff"] < 1e-5
        assert "detached" in r["old_wrapper"]


def test_no_sync_accumulates_without_communication(contract):
    _, ranks = contract
    for r in ranks:
        assert r["no_sync_calls"] == [(0, 0)] * 3  # no reduce-scatter, no all-reduce inside no_sync
        assert r["no_sync_diff"] < 1e-5


def test_autocast_is_a_clear_error(guards):
    """Defect 8: autocast around FSDP would keep every full bf16 weight alive; point to compute_dtype."""
    _, ranks = guards
    assert all("compute_dtype" in r["autocast"] for r in ranks)


def test_shapes_multihead_attention_and_bf16(guards):
    """Defect 9: the original shape is at hand; MultiheadAttention trains; a bf16 model computes in bf16."""
    _, ranks = guards
    for r in ranks:
        assert r["full_shapes"] == [(64, 32), (64,), (64, 64), (64,), (8, 64), (8,)]
        assert r["mha_diff"] < 1e-5
        assert r["bf16"] == (torch.bfloat16, {torch.bfloat16}, {torch.bfloat16})
        assert "units=(ItsType,)" in r["reads_child"] and "Linear lin.weight" in r["reads_child"]
        assert r["reads_child_as_unit"] == (2, 4)


def test_debug_mode_catches_rank_dependent_order(guards):
    """Defect 10: ranks gathering same-sized units in different orders raise on every rank with debug=True."""
    _, ranks = guards
    assert all("gathered different units" in r["debug"] for r in ranks)


def test_buffers_are_rank_0s_at_every_forward(guards):
    """Defect 11: BatchNorm statistics do not drift apart."""
    _, ranks = guards
    assert all(r["buffers_equal_at_forward"] for r in ranks)


def test_one_all_gather_and_one_reduce_scatter_per_block(units):
    """With units=(Block,) each block is gathered once per pass and reduce-scattered once per step."""
    for r in units:
        block = r["per-block"]
        assert block["diff"] < 1e-5 and r["per-linear"]["diff"] < 1e-5
        for name in ("blocks.0", "blocks.1"):
            assert block["names"].count(("all_gather", name)) == 2  # forward, and backward
            assert block["names"].count(("reduce_scatter", name)) == 1
        # every unit-level operation is exactly one collective
        assert block["collectives"].count("all_gather") == sum(k == "all_gather" for k, _ in block["names"])
        assert block["collectives"].count("reduce_scatter") == sum(k == "reduce_scatter" for k, _ in block["names"])
        # fewer calls than one unit per Linear, the same bytes (up to padding)
        linear = r["per-linear"]
        assert len(block["collectives"]) < len(linear["collectives"]) / 2
