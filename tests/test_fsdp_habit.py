"""The rank-0 checkpoint habit with FSDP: a clear error on every rank that called, in bounded time, never a hang."""

from __future__ import annotations

import pytest
import torch

import fsdp_habit_cases as C
from ddp_lib.launch import spawn


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(C.rank0_habit, world_size=2, args=(str(tmp_path_factory.mktemp("habit")),), timeout_s=90)


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
