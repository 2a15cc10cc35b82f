"""The all-reduce benchmark's buffer: every call reduces 1/world_size per rank, so the values stay 1 (they used to grow as world_size**calls and reach inf at 64 ranks), at 2 and 3 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from ddp_lib.bench.allreduce import allreduce_rank_bench
from ddp_lib.comm import spy_on
from ddp_lib.launch import spawn


def values_entering_each_call() -> list[float]:
    """Rank side: the largest |value| of every float32 buffer handed to all_reduce by the benchmark."""
    seen: list[float] = []

    def recording(tensor, *args, **kwargs):
        if tensor.dtype == torch.float32 and tensor.numel() >= 1024:  # the benchmark's buffer, not its control calls
            seen.append(tensor.abs().max().item())

    with spy_on("all_reduce", recording):
        allreduce_rank_bench([4096, 16384], iters=6, warmup=3)
    return seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_buffer_does_not_grow_with_the_calls(world_size):
    per_rank = spawn(values_entering_each_call, world_size=world_size, backend="gloo", timeout_s=120, threads=1)
    for seen in per_rank:
        assert len(seen) == 2 * (3 + 6)  # two sizes, warm-up and timed calls
        assert max(seen) == pytest.approx(1 / world_size), f"buffer grew across calls: {seen}"


def test_check_sum_flags_a_wrong_result():
    from ddp_lib.bench.allreduce import check_sum

    check_sum(torch.ones(8), torch.float32)
    check_sum(torch.full((8,), 3 * torch.tensor(1 / 3, dtype=torch.bfloat16).item(), dtype=torch.bfloat16),
              torch.bfloat16)
    with pytest.raises(RuntimeError, match="expected 1"):
        check_sum(torch.full((8,), 2.0), torch.float32)
