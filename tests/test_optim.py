"""ZeRO-1: sharded AdamW equals plain AdamW, with each rank holding about half the state."""

from __future__ import annotations

import pytest
import torch

import optim_cases as C
from ddp_lib.launch import spawn
from ddp_lib.models import ToyModel
from ddp_lib.optim import ShardedOptimizer


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
