"""check_hsdp's mutation suite on 4 gloo ranks, one spawned group: the HSDP gradient path written right (three
ways) passes, a stub reads "not written yet", and each planted mistake fails one property, the one named for it;
and once from a process with no group, where the checker ships the function to 4 ranks it starts (the notebook's way).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import all_reduce, reduce_scatter_tensor

from ddp_lib import compat
from ddp_lib.launch import spawn

GROUPS = "reduce-scatter in the shard group, all-reduce across replicas"
AVERAGE = "my chunk of the average over every rank"


def _rs(flat, group):
    out = torch.empty(flat.numel() // dist.get_world_size(group), device=flat.device)
    compat.reduce_scatter_single(out, flat, group=group)
    return out


def _n(shard, replicate):
    return dist.get_world_size(shard) * dist.get_world_size(replicate)


# ---------------------------------------------------------------- right answers
def right(flat, shard, replicate):
    out = _rs(flat, shard)
    dist.all_reduce(out, group=replicate)
    return out / _n(shard, replicate)


def right_all_reduce_first(flat, shard, replicate):  # the sums commute: the same result, a bigger all-reduce
    flat = flat.clone()
    dist.all_reduce(flat, group=replicate)
    return _rs(flat, shard) / _n(shard, replicate)


def right_divide_first_positional(flat, shard, replicate):  # pre-divided, torch's names, groups by position
    flat = flat / _n(shard, replicate)
    out = torch.empty(flat.numel() // dist.get_world_size(shard), device=flat.device)
    reduce_scatter_tensor(out, flat, dist.ReduceOp.SUM, shard)
    all_reduce(out, dist.ReduceOp.SUM, replicate)
    return out


# ---------------------------------------------------------------- planted mistakes
def all_reduce_in_shard_group(flat, shard, replicate):
    out = _rs(flat, shard)
    dist.all_reduce(out, group=shard)
    return out / _n(shard, replicate)


def reduce_scatter_across_replicas(flat, shard, replicate):
    out = _rs(flat, replicate)
    dist.all_reduce(out, group=shard)
    return out / _n(shard, replicate)


def no_all_reduce(flat, shard, replicate):
    return _rs(flat, shard) / dist.get_world_size(shard)


def all_reduce_over_world(flat, shard, replicate):
    out = _rs(flat, shard)
    dist.all_reduce(out)
    return out / _n(shard, replicate)


def reduce_scatter_without_group(flat, shard, replicate):  # the shard-sized output, over all 4 ranks: gloo raises
    out = torch.empty(flat.numel() // dist.get_world_size(shard), device=flat.device)
    compat.reduce_scatter_single(out, flat)
    dist.all_reduce(out, group=replicate)
    return out / _n(shard, replicate)


def divide_by_shard_size(flat, shard, replicate):
    out = _rs(flat, shard)
    dist.all_reduce(out, group=replicate)
    return out / dist.get_world_size(shard)


def divide_twice(flat, shard, replicate):
    out = _rs(flat / _n(shard, replicate), shard)
    dist.all_reduce(out, group=replicate)
    return out / _n(shard, replicate)


def no_divide(flat, shard, replicate):
    out = _rs(flat, shard)
    dist.all_reduce(out, group=replicate)
    return out


def stub(flat, shard, replicate):
    raise NotImplementedError("your turn")


CASES = {  # name: the properties it must fail (and nothing else), or "stub"
    "right": [], "right all-reduce first": [], "right divide first, positional": [],
    "all-reduce in the shard group": [GROUPS, AVERAGE], "reduce-scatter across replicas": [GROUPS, AVERAGE],
    "no all-reduce": [GROUPS, AVERAGE], "all-reduce over all ranks": [GROUPS, AVERAGE],
    "reduce-scatter without group=": [GROUPS, AVERAGE],
    "divide by the shard size only": [AVERAGE], "divide twice": [AVERAGE], "no divide": [AVERAGE],
}
FNS = [right, right_all_reduce_first, right_divide_first_positional, all_reduce_in_shard_group,
       reduce_scatter_across_replicas, no_all_reduce, all_reduce_over_world, reduce_scatter_without_group,
       divide_by_shard_size, divide_twice, no_divide]


def run_suite() -> dict:
    from ddp_lib.check.hsdp_grads import check_hsdp

    out = {}
    for name, fn in zip(list(CASES) + ["stub"], FNS + [stub]):
        res = check_hsdp(fn, timeout_s=20)
        out[name] = [(r.name, r.status, r.detail) for r in res.rows]
    return out


def test_mutations_on_four_ranks():
    ranks = spawn(run_suite, world_size=4, backend="gloo", timeout_s=180)
    for out in ranks:
        for name, failing in CASES.items():
            rows = out[name]
            failed = [n for n, status, _ in rows if status == "FAIL"]
            assert failed == failing[:1], (name, rows)  # one mistake, one diagnosis
            if failing[1:]:
                assert rows[1][1] == "not checked", (name, rows)
        assert {status for _, status, _ in out["stub"]} == {"not written yet", "not checked"}
    diagnosis = {name: next((d for _, s, d in ranks[0][name] if s == "FAIL"), "") for name in CASES}
    assert "no all-reduce across replicas" in diagnosis["no all-reduce"]
    assert "belongs to the shard group" in diagnosis["reduce-scatter across replicas"]
    assert "inside the shard group" in diagnosis["all-reduce in the shard group"]
    assert "over all ranks" in diagnosis["all-reduce over all ranks"]
    assert "reduce_scatter in the world group" in diagnosis["reduce-scatter without group="]
    assert "divided by the shard size only" in diagnosis["divide by the shard size only"]
    assert "divided twice" in diagnosis["divide twice"]
    assert "not divided at all" in diagnosis["no divide"]


def test_shipped_to_four_ranks_from_a_process_without_a_group():
    from ddp_lib.check.hsdp_grads import check_hsdp

    assert not dist.is_initialized()
    assert check_hsdp(right, timeout_s=20).passed
