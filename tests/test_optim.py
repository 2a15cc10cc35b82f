"""ZeRO-1: sharded AdamW equals plain AdamW, with each rank holding about half the state."""

from __future__ import annotations

import pytest
import torch

import optim_cases as C
from ddp_lib.launch import spawn
from ddp_lib.kit.models import ToyModel
from ddp_lib.zero import ShardedOptimizer


@pytest.fixture(scope="module", params=[False, True], ids=["one-group", "add_param_group"])
def runs(request):
    return spawn(C.both, world_size=2, args=(request.param,), timeout_s=120)


def test_parameters_equal_plain_adamw(runs):
    for rank in runs:
        for got, want in zip(rank["sharded"]["params"], rank["plain"]["params"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(runs[0]["sharded"]["params"], runs[1]["sharded"]["params"]):
        assert torch.equal(a, b)  # every rank holds every updated parameter


def test_state_is_sharded_and_balanced(runs):
    plain = runs[0]["plain"]["state_bytes"]
    per_rank = [r["sharded"]["state_bytes"] for r in runs]
    print(f"\nAdamW state bytes: plain {plain} per rank; ZeRO-1 {per_rank} (2 ranks)")
    assert sum(per_rank) == plain  # nothing duplicated, nothing missing
    assert max(per_rank) <= 0.6 * plain  # balanced: each rank about half
    numel = [r["sharded"]["shard_numel"] for r in runs]
    assert sum(numel) == sum(p.numel() for p in ToyModel(depth=3).parameters())


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="not initialised"):
        ShardedOptimizer(ToyModel().parameters(), torch.optim.AdamW, lr=1e-3)


def test_resume_with_a_scheduler_is_exact():
    """6 steps straight == 3 steps, save, rebuild, load, 3 steps (AdamW + LambdaLR, ZeRO-1 on 2 ranks)."""
    for rank in spawn(C.resume_both, world_size=2, timeout_s=120):
        for a, b in zip(rank["straight"], rank["resumed"]):
            assert torch.equal(a, b)


def test_process_group_is_used_for_rank_size_and_collectives():
    """A group of global ranks 1 and 2 out of 3: group ranks 0 and 1, broadcasts from global ranks."""
    r0, r1, r2 = spawn(C.subgroup, world_size=3, timeout_s=120)
    assert r0 is None
    assert (r1["group_rank"], r1["group_size"]) == (0, 2) and (r2["group_rank"], r2["group_size"]) == (1, 2)
    assert r1["state_bytes"] + r2["state_bytes"] == r1["plain_bytes"]  # sharded over the group's 2 ranks
    for r in (r1, r2):
        for got, want in zip(r["sharded"], r["plain"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
