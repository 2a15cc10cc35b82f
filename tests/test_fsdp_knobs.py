"""Lesson 08's knobs table on 4 gloo ranks: each setting changes what the lesson says it changes, and `seeded_init_`
gives the same model on 4 ranks as on one process (uneven rows), gathered alike by `gather_full` and
`full_tensor()`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ddp_lib.bench.fsdp_knobs import knobs, link_ms, lm_blocks, payload_bytes, tiny_lm
from ddp_lib.torch_fsdp.dcp import gather_full
from ddp_lib.torch_fsdp.meta_device import seeded_init_, sharded_on_meta
from ddp_lib.launch import spawn
from ddp_lib.kit.models import ToyModel


def _knobs_and_init() -> dict:
    tokens = torch.randint(0, 512, (8, 17), generator=torch.Generator().manual_seed(0))
    out = knobs(tiny_lm, lm_blocks, tokens, steps=2)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = sharded_on_meta(lambda: ToyModel(8, 30, 4, depth=2), mesh, seed=3)  # 30 rows: uneven over 4 ranks
    out["init"] = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["gather_full"] = all(torch.equal(gather_full(p), p.full_tensor()) for p in model.parameters())
    return out


def test_knobs_on_four_ranks():
    ranks = spawn(_knobs_and_init, world_size=4, timeout_s=300)
    want = dict(seeded_init_(ToyModel(8, 30, 4, depth=2), 3).named_parameters())
    for r in ranks:
        assert all(torch.equal(r["init"][n], w) for n, w in want.items()) and r["gather_full"]
        T, Fa, I = r["reshard_after_forward=True"], r["reshard_after_forward=False"], r["reshard_after_forward=2"]
        P, A = r["True + prefetch 2 blocks ahead"], r["True + activation checkpointing"]
        assert Fa["all_gathers"] < T["all_gathers"] and Fa["gathered_bytes"] < T["gathered_bytes"]
        assert T["forward_bytes"] < I["forward_bytes"] < Fa["forward_bytes"]
        assert I["gather_groups"] == [2, 4] and T["gather_groups"] == [4]
        assert P["all_gathers"] == T["all_gathers"] and P["forward_bytes"] == T["forward_bytes"]
        # checkpointing keeps less between forward and backward; its peak (during backward, with the recomputed
        # block) came out above or below T's (1.28 MB against 1.21 MB in one CI run; why it varies from run to run is
        # not established): not asserted
        assert A["forward_bytes"] < T["forward_bytes"]
        assert T["reduce_scatters"] == len(lm_blocks(tiny_lm())) + 1  # each block and the root, once
        assert link_ms(Fa["calls"], 100, 0.125) < link_ms(T["calls"], 100, 0.125)
        # a reduce-scatter is counted by its full-size input, not the shard it leaves: without resharding each group
        # is gathered once and reduce-scattered once, the same full (padded) bytes both ways
        assert Fa["reduced_bytes"] == Fa["gathered_bytes"] and T["reduced_bytes"] == Fa["gathered_bytes"]
        assert r["accumulation"] == {"reduce_scatters_no_sync": 0, "reduce_scatters_sync": T["reduce_scatters"]}


def test_payload_is_the_full_tensor():
    """The reduce-scatter counts its input (full size), not its output shard; an all-reduce its list of tensors."""
    shard, full = torch.empty(8), torch.empty(32)
    assert payload_bytes("reduce_scatter", (shard, full, None)) == 32 * 4
    assert payload_bytes("all_gather", (full, shard, None)) == 32 * 4
    assert payload_bytes("all_reduce", ([full, shard], None)) == 40 * 4


def test_link_ms_counts_an_all_reduce_as_two_passes():
    one = link_ms([("reduce_scatter", 10**6, 4)], alpha_us=0, bandwidth_GBps=1)
    assert link_ms([("all_reduce", 10**6, 4)], alpha_us=0, bandwidth_GBps=1) == 2 * one
    assert abs(one - 0.75) < 1e-9  # (n-1)/n of 1 MB at 1 GB/s
