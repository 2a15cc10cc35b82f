"""ddp_lib.mesh: get() with and without a registered DeviceMesh, backend choice, init errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_lib.launch import RankError, spawn
from ddp_lib.mesh import check_gpu_for_rank, get, init_distributed, pick_backend, rank_device


def lookups() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    before = {k: get(k) for k in ("ws", "rank", "grank", "lrank")}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    get.register_mesh(mesh)
    try:
        after = {k: get(k) for k in ("ws", "rank", "grank", "lrank")}
        pg_is_mesh_group = get("pg") is mesh.get_group()
        explicit = get("ws", mesh)
    finally:
        get.register_mesh(None)
    return {"before": before, "after": after, "pg_is_mesh_group": pg_is_mesh_group,
            "explicit": explicit, "default_pg": get("pg") is dist.group.WORLD}


def test_get_without_and_with_a_registered_mesh():
    results = spawn(lookups, world_size=2)
    for rank, r in enumerate(results):
        want = {"ws": 2, "rank": rank, "grank": rank, "lrank": rank}
        assert r["before"] == want and r["after"] == want
        assert r["pg_is_mesh_group"] and r["explicit"] == 2 and r["default_pg"]


def test_unknown_key_names_the_valid_ones():
    with pytest.raises(ValueError, match="ws, pg, rank, grank, lrank"):
        get("world")


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` GPUs (0: none) and a torch with NCCL; returns the setter."""
    def have(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    return have


def torchrun_env(monkeypatch, world_size: int, local_world_size: int | None, local_rank: int = 0) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))


def test_cpu_machine_picks_gloo(gpus):
    gpus(0)
    assert pick_backend(2) == "gloo"


def test_a_gpu_per_rank_picks_nccl_and_too_few_gpus_gloo(gpus):
    gpus(2)
    assert pick_backend(2) == "nccl"
    assert pick_backend(3) == "gloo"


def test_multi_node_torchrun_job_counts_the_gpus_of_its_own_node(gpus, monkeypatch):
    gpus(8)
    torchrun_env(monkeypatch, world_size=16, local_world_size=8, local_rank=7)  # 2 nodes x 8 GPUs
    assert pick_backend() == "nccl"
    assert rank_device("nccl") == torch.device("cuda", 7)  # LOCAL_RANK, not the global rank
    torchrun_env(monkeypatch, world_size=16, local_world_size=9)  # 9 ranks on a node with 8 GPUs
    assert pick_backend() == "gloo"


def test_without_local_world_size_the_job_is_taken_as_one_node(gpus, monkeypatch):
    gpus(2)
    torchrun_env(monkeypatch, world_size=4, local_world_size=None)
    assert pick_backend() == "gloo"
    torchrun_env(monkeypatch, world_size=2, local_world_size=None)
    assert pick_backend() == "nccl"


def test_an_nccl_rank_without_a_gpu_is_a_clear_error_naming_it(gpus, monkeypatch):
    gpus(2)
    check_gpu_for_rank(rank=9, local_rank=1)  # has cuda:1
    with pytest.raises(RuntimeError, match=r"rank 10 \(local rank 2 .*\) has no GPU.*sees 2 GPU"):
        check_gpu_for_rank(rank=10, local_rank=2)
    gpus(0)
    with pytest.raises(RuntimeError, match="rank 3 .* has no GPU"):
        check_gpu_for_rank(rank=3, local_rank=0)


def test_init_with_nccl_on_a_rank_without_gpu_fails_before_joining(gpus, monkeypatch):
    gpus(1)
    torchrun_env(monkeypatch, world_size=2, local_world_size=2, local_rank=1)
    monkeypatch.setenv("MASTER_PORT", "1")  # never reached: the check comes first
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: pytest.fail("joined the group"))
    with pytest.raises(RuntimeError, match="rank 1 .* has no GPU"):
        init_distributed(backend="nccl")


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise KeyError("boom on rank 1")
    dist.barrier()  # rank 0 waits in a collective the failed rank never joins


def test_a_failing_rank_is_reported_and_nobody_hangs():
    with pytest.raises(RankError, match="boom on rank 1"):
        spawn(_fail_on_rank1, world_size=2, timeout_s=30)


def test_init_without_port_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_PORT"):
        init_distributed(backend="gloo")
