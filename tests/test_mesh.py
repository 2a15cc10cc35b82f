"""ddp_lib.mesh: get() with and without a registered DeviceMesh, backend choice, init errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_lib.launch import RankError, spawn
from ddp_lib.devices import check_gpu_for_rank, init_distributed, pick_backend, rank_device
from ddp_lib.mesh import get


def lookups() -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    before = {k: get(k) for k in ("ws", "rank", "grank", "lrank")}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
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


def mesh_2x2() -> dict:
    """Every lookup on a dp x tp = 2 x 2 mesh, by dimension name, index and sub-mesh, plus the errors."""
    from torch.distributed.device_mesh import init_device_mesh

    dm = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for dim in ("dp", "tp", 0, 1):
        out[dim] = dict(ws=get("ws", dm, dim), rank=get("rank", dm, dim), grank=get("grank", dm, dim),
                        lrank=get("lrank", dm, dim),
                        pg_members=sorted(dist.get_process_group_ranks(get("pg", dm, dim))))
    out["sub"] = {d: (get("ws", dm[d]), get("rank", dm[d])) for d in ("dp", "tp")}
    get.register_mesh(dm, "dp")
    try:
        out["registered"] = (get("ws"), get("rank"), get("ws", mesh_dim="tp"), get("rank", mesh_dim="tp"))
    finally:
        get.register_mesh(None)
    # the old bug: rank and ws from one group, so a batch is sharded within the dp group
    x = torch.arange(8.0)
    out["shard"] = x.chunk(get("ws", dm, "dp"))[get("rank", dm, "dp")].tolist()
    errors = []
    for call in (lambda: get("ws", dm), lambda: get("rank", dm, "pp"), lambda: get("ws", None, "dp")):
        try:
            call()
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


def test_get_on_a_2x2_mesh_answers_per_dimension():
    results = spawn(mesh_2x2, world_size=4, timeout_s=180)
    for g, r in enumerate(results):
        dp, tp = divmod(g, 2)  # init_device_mesh lays ranks out row-major: [[0, 1], [2, 3]]
        want_dp = dict(ws=2, rank=dp, grank=g, lrank=g, pg_members=[tp, tp + 2])
        want_tp = dict(ws=2, rank=tp, grank=g, lrank=g, pg_members=[2 * dp, 2 * dp + 1])
        assert r["dp"] == r[0] == want_dp, (g, r)
        assert r["tp"] == r[1] == want_tp, (g, r)
        assert r["sub"] == {"dp": (2, dp), "tp": (2, tp)}
        assert r["registered"] == (2, dp, 2, tp)
        assert r["shard"] == [4.0 * dp + i for i in range(4)]
        no_dim, bad_name, no_mesh = r["errors"]
        assert no_dim and "mesh_dim='dp'" in no_dim and "('dp', 'tp')" in no_dim
        assert bad_name and "'pp'" in bad_name
        assert no_mesh and "without a mesh" in no_mesh


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


# -- the device comes from the group's own backends, never from get_backend() == "nccl" --

def devices_of_real_groups() -> dict:
    """comm_device/rank_device for gloo groups: the default one, a new one, one started with no backend,
    and one started with a per-device config (their get_backend() is "undefined" and the config string)."""
    from ddp_lib.devices import group_backends
    from ddp_lib.devices import comm_device

    out = {"default": (dist.get_backend(), comm_device(), rank_device())}
    sub = dist.new_group(backend="gloo")
    out["new_group"] = (dist.get_backend(sub), comm_device(sub))
    store = dist.HashStore()
    for name, backend in (("undefined", None), ("config", "cpu:gloo,cuda:gloo")):
        dist.destroy_process_group()
        dist.init_process_group(backend=backend, store=store if backend is None else dist.HashStore(),
                                rank=0, world_size=1)
        out[name] = (dist.get_backend(), comm_device(), rank_device(), rank_device(dist.get_backend()),
                     group_backends())
    out["gpu"] = torch.cuda.is_available()
    return out


def test_gloo_groups_of_every_spelling_communicate_on_the_cpu():
    r = spawn(devices_of_real_groups, world_size=1, timeout_s=60)[0]
    cpu = torch.device("cpu")
    assert r["default"] == ("gloo", cpu, cpu)
    assert r["new_group"] == ("gloo", cpu)
    assert r["config"][:4] == ("cpu:gloo,cuda:gloo", cpu, cpu, cpu)
    # no backend named: where the rank sees a GPU (the CUDA build on a GPU box) torch gives CUDA tensors nccl (torch
    # 2.11 on an H200 configured nccl alone), and the group computes and communicates on the GPU; elsewhere (the
    # CPU build, or the GPUs hidden) gloo, on the CPU
    on = torch.device("cuda", 0) if r["gpu"] else cpu
    assert r["undefined"][:4] == ("undefined", on, on, on), r["undefined"]
    assert r["undefined"][4].get("cuda" if r["gpu"] else "cpu") == ("nccl" if r["gpu"] else "gloo"), r["undefined"]


@pytest.fixture
def fake_group(monkeypatch, gpus):
    """An initialised default group whose backend config is what the test says, on a box with 4 GPUs."""
    def make(config: str, backend_name: str) -> None:
        gpus(4)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend_name)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        monkeypatch.setenv("LOCAL_RANK", "3")
    return make


@pytest.mark.parametrize("config,name", [("cuda:nccl", "nccl"), ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
                                         ("cpu:gloo,cuda:nccl", "undefined")])
def test_a_group_with_nccl_for_cuda_communicates_on_the_gpu(fake_group, config, name):
    from ddp_lib.devices import comm_device

    fake_group(config, name)
    assert comm_device() == torch.device("cuda", 3)
    assert rank_device() == rank_device(name) == torch.device("cuda", 3)


def test_nccl_config_without_a_visible_gpu_and_gloo_for_cuda_stay_on_the_cpu(fake_group, gpus):
    from ddp_lib.devices import comm_device

    fake_group("cpu:gloo,cuda:nccl", "undefined")  # init_process_group() on a CUDA build, GPUs hidden
    gpus(0)
    assert comm_device() == rank_device() == torch.device("cpu")
    fake_group("cpu:gloo,cuda:gloo", "gloo")  # gloo accepts CUDA tensors, but it is a CPU backend
    assert comm_device() == rank_device("gloo") == torch.device("cpu")


def test_an_unknown_backend_name_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot tell the devices of backend 'nccl2'"):
        rank_device("nccl2")


def test_the_lessons_scale_switch_follows_the_group_not_a_backend_string(fake_group, gpus, monkeypatch):
    from ddp_lib.devices import small_scale

    monkeypatch.delenv("DDP_SMALL", raising=False)
    fake_group("cpu:gloo,cuda:nccl", "undefined")  # a GPU group whose get_backend() is not "nccl"
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": 80 * 2**30})())  # an 80 GiB card
    assert small_scale() is False
    monkeypatch.setenv("DDP_SMALL", "1")
    assert small_scale() is True
    monkeypatch.delenv("DDP_SMALL")
    fake_group("cpu:gloo,cuda:gloo", "gloo")
    assert small_scale() is True
