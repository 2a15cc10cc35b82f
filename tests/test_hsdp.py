"""HSDP on a (2, 2) mesh of 4 gloo ranks, one spawned group: the gradient path (reduce-scatter in the shard group,
all-reduce across replicas), the course's `FSDP(mesh=...)` against one process on the full batch, and beside
torch's `fully_shard(mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))`.
fp32 throughout: only the order of the sums differs, tolerance 1e-5."""

from __future__ import annotations

import pytest

import hsdp_cases as C
from ddp_lib.launch import spawn

TOL = 1e-5


@pytest.fixture(scope="module")
def hsdp_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("hsdp")


@pytest.fixture(scope="module")
def ranks(hsdp_dir):
    # spawn picks a free port per run and ends every rank (by PID) when one fails or the time runs out
    return spawn(C.run, world_size=4, backend="gloo", args=(str(hsdp_dir),), timeout_s=120)


def test_groups_follow_the_mesh(ranks):
    shard, replicate = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    for r, out in enumerate(ranks):
        assert out["groups"] == [shard[r // 2], replicate[r % 2]]


def test_reduce_gradient_is_my_chunk_of_the_average(ranks):
    assert all(out["reduce_gradient_diff"] < TOL for out in ranks)


def test_fsdp_on_a_2d_mesh_trains_like_one_process(ranks):
    for out in ranks:
        assert out["one_process"]["loss_diff"] < TOL
        assert out["one_process"]["param_diff"] < TOL
        assert out["shard_numel"] == C.DIM * C.DIM // 2  # sharded over the shard group (2), not over all 4


def test_one_reduce_scatter_and_one_replica_all_reduce_per_unit(ranks):
    for out in ranks:
        calls = out["comm_calls_by_kind"]  # the last step's (published when its backward ended)
        assert calls["reduce_scatter"] == out["units"]
        assert calls["all_reduce"] == out["units"] + 1  # + the replicated biases: one flat all-reduce
        assert out["comm_calls"] == sum(calls.values())  # the all-gathers too: one type, an int


def test_beside_torch_fully_shard_on_the_same_mesh(ranks):
    for out in ranks:
        fs = out["fully_shard"]
        assert fs["placements"] == "(Replicate(), Shard(dim=0))"
        assert max(abs(a - b) for a, b in zip(fs["ours"], fs["fully_shard"])) < TOL
        assert fs["max_param_diff"] < TOL


def test_sharded_checkpoint_one_file_per_shard_rank_loaded_by_every_replica(ranks):
    for out in ranks:
        assert out["sharded_checkpoint"]["files"] == ["shard-rank00000-of-00002.pt", "shard-rank00001-of-00002.pt"]
        assert out["sharded_checkpoint"]["diff"] == 0


def test_mesh_and_process_group_together_is_a_clear_error(ranks):
    assert all("pass mesh= (HSDP) or process_group=, not both" in out["both"] for out in ranks)
