"""ddp_lib.mesh: get() with and without a registered DeviceMesh, backend choice, init errors."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ddp_lib.launch import RankError, spawn
from ddp_lib.mesh import get, init_distributed, pick_backend


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


def test_cpu_machine_picks_gloo():
    assert pick_backend(2) == "gloo"


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
