"""The DDP race builds, times and frees one variant at a time, and reads torch DDP's buckets through public APIs."""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.bench import ddp_step
from ddp_lib.bench.workloads import Workload
from ddp_lib.launch import spawn
from ddp_lib.kit.models import ToyModel


def _live_variants_at_each_build() -> dict:
    """Rank side: how many earlier variants are still alive whenever the race builds the next one."""
    live: weakref.WeakSet = weakref.WeakSet()
    seen: list[int] = []

    class Tracked(ddp_step.VariantRun):
        def __init__(self, *args, **kwargs):
            seen.append(len(live))
            super().__init__(*args, **kwargs)
            live.add(self)

    ddp_step.VariantRun = Tracked
    rows = ddp_step.ddp_rank_bench("toy", ["naive", "bucketed", "torch"], steps=2, warmup=1, rounds=2)
    first = len(seen)
    # a second race in the same process (lesson 05's simulated link) may skip the allocator warm-up pass
    again = ddp_step.ddp_rank_bench("toy", ["naive", "bucketed"], steps=2, warmup=1, rounds=2, allocator_warmup=False)
    return {"seen": seen[:first], "seen_again": seen[first:], "rows": rows, "rows_again": again}


def test_one_variant_alive_at_a_time_over_rounds():
    for r in spawn(_live_variants_at_each_build, world_size=2, timeout_s=120, threads=1):
        # 4 variants (nocomm too) x (the allocator warm-up pass + 2 rounds), none alive when the next is built
        assert r["seen"] == [0] * 12
        rows = {row["variant"]: row for row in r["rows"]}
        assert list(rows) == ["nocomm", "naive", "bucketed", "torch"]
        assert all(row["steps"] == 4 for row in rows.values())  # 2 timed steps per round
        assert all(rows[v]["param_diff"] <= 1e-5 for v in ("naive", "bucketed", "torch"))
        assert all(row["peak_mem_mb"] is not None for row in rows.values())
        # without the warm-up pass: 3 variants x 2 rounds builds, the same timed steps, still equal to the reference
        assert r["seen_again"] == [0] * 6
        assert [row["steps"] for row in r["rows_again"]] == [4, 4, 4]
        assert all(row["param_diff"] <= 1e-5 for row in r["rows_again"][1:])


def _torch_ddp_messages() -> dict:
    """Rank side: torch DDP's all-reduces of a float64 model, seen by the recording comm hook."""
    torch.manual_seed(0)
    work = Workload("toy64", lambda: ToyModel(32, 64, 8).double(),
                    lambda g, n: (torch.randn(n, 32, generator=g, device="cpu", dtype=torch.float64),
                                  torch.randn(n, 8, generator=g, device="cpu", dtype=torch.float64)),
                    lambda m, b: F.mse_loss(m(b[0]), b[1]), 8)
    base = work.build()
    batch = ddp_step._shard(work.batch(torch.Generator().manual_seed(1), 8), torch.device("cpu"))
    run = ddp_step.VariantRun("torch:0.001", base, work, 25.0, 1e-3, torch.device("cpu"))
    for _ in range(2):
        run.step(batch)
    msgs = run.messages(batch)
    return {"msgs": msgs, "numel": sum(p.numel() for p in base.parameters()), "n_params": len(list(base.parameters())),
            "rank": dist.get_rank()}


def test_torch_ddp_buckets_have_the_real_element_size():
    for r in spawn(_torch_ddp_messages, world_size=2, timeout_s=120, threads=1):
        assert {dtype for _, dtype in r["msgs"]} == {torch.float64}
        assert sum(n for n, _ in r["msgs"]) == r["numel"]  # elements, not bytes / 4
        assert 1 < len(r["msgs"]) <= r["n_params"]  # a 1 KB cap splits the model into several buckets
