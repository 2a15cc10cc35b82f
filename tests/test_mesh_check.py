"""ddp_lib.check.mesh_get.check_get on 2 gloo ranks: the package's get passes, a stub reads "not written yet",
planted mistakes (the old get that mixed groups among them) fail the property named for them; 4 ranks too."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from ddp_lib.launch import spawn


def get_stub(key, dm=None, mesh_dim=None):
    raise NotImplementedError("your turn")


def get_global_rank(key, dm=None, mesh_dim=None):
    """The old get: ws from the mesh's group, rank always global, no mesh_dim."""
    pg = dm.get_group() if dm is not None else None
    return {"ws": lambda: dist.get_world_size(pg), "pg": lambda: pg or dist.group.WORLD, "rank": dist.get_rank,
            "grank": dist.get_rank, "lrank": lambda: int(os.environ.get("LOCAL_RANK", 0))}[key]()


def get_world_always(key, dm=None, mesh_dim=None):
    """Ignores the mesh: the world's size and rank everywhere."""
    from ddp_lib.mesh import get

    return {"ws": dist.get_world_size(), "rank": dist.get_rank()}.get(key) if key in ("ws", "rank") else get(key, dm, mesh_dim)


def get_lrank_from_mesh(key, dm=None, mesh_dim=None):
    """`lrank` as the mesh-local rank (a second meaning that made it ambiguous)."""
    from ddp_lib.mesh import get

    if key == "lrank" and dm is not None:
        return get("rank", dm, mesh_dim)
    return get(key, dm, mesh_dim)


CASES = ["package", "stub", "get_global_rank", "get_world_always", "get_lrank_from_mesh"]


def run_cases() -> dict:
    from ddp_lib.check.mesh_get import check_get
    from ddp_lib.mesh import get

    fns = {"package": get, "stub": get_stub, "get_global_rank": get_global_rank,
           "get_world_always": get_world_always, "get_lrank_from_mesh": get_lrank_from_mesh}
    out = {}
    for name in CASES:
        res = check_get(fns[name], timeout_s=10)
        out[name] = {"passed": res.passed, "failed": res.failed, "table": res.table(),
                     "rows": {r.name: r.status for r in res.rows}}
    out["again"] = check_get(get, timeout_s=10, quiet=True).passed  # the cell re-run: cached meshes, still right
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(run_cases, 2, backend="gloo", timeout_s=180)


def test_identical_on_every_rank(results):
    for name in CASES:
        assert results[0][name]["failed"] == results[1][name]["failed"], name


def test_the_package_passes_twice(results):
    assert results[0]["package"]["passed"], results[0]["package"]["table"]
    assert results[0]["again"] and results[1]["again"]


def test_stub_reads_not_written_yet(results):
    res = results[0]["stub"]
    statuses = list(res["rows"].values())
    # a property that needs an unwritten one waits for it ("not checked"): no property fails
    assert statuses[0] == "not written yet" and set(statuses) <= {"not written yet", "not checked"}, res["table"]


@pytest.mark.parametrize("name, prop", [
    ("get_global_rank", "2-D mesh: one group per dimension"),
    ("get_world_always", "2-D mesh: one group per dimension"),
    ("get_lrank_from_mesh", "grank global, lrank node-local"),
])
def test_planted_mistake_fails_its_property(results, name, prop):
    res = results[0][name]
    assert not res["passed"] and prop in res["failed"], res["table"]
    assert "no mesh: the world" not in res["failed"], res["table"]  # the mistake is named, not everything


def _four() -> bool:
    from ddp_lib.check.mesh_get import check_get
    from ddp_lib.mesh import get

    return check_get(get, timeout_s=10, quiet=True).passed and not check_get(get_world_always, timeout_s=10,
                                                                             quiet=True).passed


def test_four_ranks():
    assert spawn(_four, 4, backend="gloo", timeout_s=180) == [True] * 4
