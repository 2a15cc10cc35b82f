"""FSDP on 2 gloo ranks, one spawned group: the rank-0 checkpoint habit (a clear error on every rank that called, in
bounded time, never a hang), a unit's lifecycle (SHARDED -> UNSHARDING -> UNSHARDED -> SHARDED), and
the course's FSDP against torch's fully_shard (FSDP2) on the same model and batches; DCP checkpoints saved by 4 ranks
(a second spawned group) and loaded by the 2."""

from __future__ import annotations

import pytest
import torch

import fsdp_dcp_cases as D
import fsdp_habit_cases as C
from ddp_lib.launch import spawn


@pytest.fixture(scope="module")
def dcp_written(tmp_path_factory):
    """torch's fully_shard model and AdamW trained and saved with DCP by 4 ranks (read below by the 2 ranks)."""
    directory = str(tmp_path_factory.mktemp("dcp"))
    return directory, spawn(D.writer, world_size=4, args=(directory,), timeout_s=120)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, dcp_written):
    return spawn(C.run, world_size=2, args=(str(tmp_path_factory.mktemp("habit")), dcp_written[0]), timeout_s=90)


def test_state_dict_on_rank0_alone_raises_within_the_timeout(ranks):
    alone = ranks[0]["alone"]
    assert alone["raised"] == "EntryMismatch"
    assert "did not call state_dict() within 1 s" in alone["msg"]
    assert "call state_dict() on every rank, save on rank 0" in alone["msg"]
    assert 0.9 <= alone["s"] < 10


def test_group_is_usable_after_the_abandoned_call(ranks):
    for k, v in ranks[0]["after_alone"].items():
        torch.testing.assert_close(ranks[1]["after_alone"][k], v, rtol=0, atol=0)


def test_peer_in_next_step_makes_both_ranks_raise_at_once(ranks):
    for r in ranks:
        moved = r["moved_on"]
        assert moved["raised"] == "EntryMismatch", moved
        assert "rank 0: state_dict(), rank 1: forward()" in moved["msg"]
        assert "call state_dict() on every rank, save on rank 0" in moved["msg"]
        assert moved["s"] < 10  # the state-dict wait is 30 s: nobody waited for it


def test_state_dict_on_every_rank_then_save_on_rank0_works(ranks):
    assert all(r["saved_equals_gathered"] for r in ranks)
    for k, v in ranks[0]["final"].items():
        torch.testing.assert_close(ranks[1]["final"][k], v, rtol=0, atol=0)
    assert any(not torch.equal(ranks[0]["final"][k], ranks[0]["after_alone"][k]) for k in ranks[0]["final"])


def test_unit_lifecycle_verbs_and_states(ranks):
    for r in ranks:
        life = r["lifecycle"]
        assert life["UnitState"] == ["SHARDED", "UNSHARDING", "UNSHARDED"]
        assert life["seen"] == ["SHARDED", "UNSHARDING", "UNSHARDED", "SHARDED"]
        assert life["equal"]  # the gathered weight is the full one
        assert len(life["errors"]) == 2
        assert "wait_for_unshard() while SHARDED" in life["errors"][0]
        assert "unshard() while UNSHARDING" in life["errors"][1]


def test_state_dict_honours_keep_vars_and_prefix_and_refuses_what_it_cannot_honour(ranks):
    for r in ranks:
        assert r["lifecycle"]["state_dict_args"] == {"keep_vars_bias_is_the_parameter": True,
                                                     "plain_bias_is_a_copy": True, "same_values": True,
                                                     "prefixed": True, "refused": 2}


def test_forward_unshards_one_unit_at_a_time_and_backward_reshards_all(ranks):
    for r in ranks:
        life = r["lifecycle"]
        # layer 1 starts: layer 0 resharded, layer 1 gathered, the head's all-gather prefetched (in flight)
        assert life["during"] == [("SHARDED", "UNSHARDED", "UNSHARDING")]
        assert set(life["after"].values()) == {"SHARDED"} and len(life["after"]) == 3


@pytest.mark.parametrize("dtype,tol", [("None", 1e-6), ("torch.bfloat16", 1e-3)])
def test_trains_like_torch_fully_shard(ranks, dtype, tol):
    """compute_dtype=bf16 against MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the same recipe."""
    for r in ranks:
        res = r["fully_shard"][dtype]
        assert res["ours"] == pytest.approx(res["fully_shard"], abs=tol)
        assert res["max_param_diff"] <= tol
        assert res["param_type"] == "DTensor" and res["placements"] == "(Shard(dim=0),)"


def test_sharded_checkpoint_carries_the_optimizer(ranks):
    for r in ranks:
        assert r["sharded_optim"]["resumed_diff"] == 0.0  # AdamW's moments and step came back bit for bit


def test_dcp_two_ranks_load_what_four_saved(ranks, dcp_written):
    written = dcp_written[1][0]
    for r in ranks:
        read = r["dcp"]
        assert any(not torch.equal(read["fresh"][n], t) for n, t in written["saved"].items())
        for n, t in written["saved"].items():
            torch.testing.assert_close(read["loaded"][n], t, rtol=0, atol=0)


def test_dcp_optimizer_state_resumes_across_the_world_size_change(ranks, dcp_written):
    """AdamW's moments and step count came back: the next step equals the 4-rank run's next step."""
    written = dcp_written[1][0]
    for r in ranks:
        assert r["dcp"]["adam_steps"] == [3.0]  # two saved steps + one
        for n, t in written["next"].items():
            torch.testing.assert_close(r["dcp"]["next"][n], t, rtol=0, atol=1e-6)


def test_the_entry_agreement_stays_off_the_forward_unless_debug():
    for got in spawn(C.entry_numbers, world_size=2, timeout_s=90):
        assert got == {False: 1, True: 3}  # state_dict() alone; with debug=True each forward too


def test_dcp_reload_hands_back_one_copy_of_the_full_parameters(dcp_written):
    """Lesson 08 reads rank 0's: every rank's would put one full model per rank into the caller's memory (at its
    real sizes, 3 x 0.6 GB more on the lesson's rank 0)."""
    import torch.nn as nn

    from ddp_lib.kit.models import ToyModel
    from ddp_lib.torch_fsdp import dcp as TD

    directory, (written, *_) = dcp_written
    got = spawn(TD.reload, world_size=2, args=(directory, ToyModel, (nn.Linear,)), timeout_s=90)
    assert [r["params"] is None for r in got] == [False, True]
    for n, t in written["saved"].items():
        torch.testing.assert_close(got[0]["params"][n], t, rtol=0, atol=0)
    assert got[0]["adam_steps"] == got[1]["adam_steps"] == [2.0]
