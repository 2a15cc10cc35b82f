"""Checker of lesson 00: the learner's `get(key, dm=None, mesh_dim=None)` answers "who am I?" per mesh dimension.

    from ddp_lib.check.mesh_get import check_get
    check_get(get);   # on every rank: one table from rank 0
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch.distributed as dist

from ddp_lib.check._runner import CheckResult, Mismatch, Property, learner_namespaces, run_check
from ddp_lib.devices import comm_device, needs_process_group
from ddp_lib.launch import restored_environ

# built once per default group (held, so a rebuilt group is never mistaken for it): re-running the check
# cell makes no new groups
_meshes: list = []


def _meshes_for_this_group() -> tuple[Any, Any]:
    """A 1-D data-parallel mesh over every rank and a 2-D (dp=world, tp=1) mesh, built outside the properties."""
    from torch.distributed.device_mesh import init_device_mesh

    if not _meshes or _meshes[0] is not dist.group.WORLD:
        ws, device_type = dist.get_world_size(), comm_device().type
        _meshes[:] = [dist.group.WORLD, init_device_mesh(device_type, (ws,), mesh_dim_names=("dp",)),
                      init_device_mesh(device_type, (ws, 1), mesh_dim_names=("dp", "tp"))]
    return _meshes[1], _meshes[2]


_NODE_ENV = ("LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE")


@contextmanager
def _layouts(rank: int) -> Iterator[Callable[[], Iterator[tuple[str, int]]]]:
    """Yield a generator of (label, LOCAL_RANK) over two layouts: the real one, then a simulated multi-node
    job in which every node runs one process (as torchrun sets LOCAL_RANK=0, GROUP_RANK=node,
    LOCAL_WORLD_SIZE=1 there), so that the global and the node-local rank differ; the environment is restored."""
    local = os.environ.get("LOCAL_RANK")  # as the job set it: each() may run more than once

    def each() -> Iterator[tuple[str, int]]:
        yield "", int(local if local is not None else rank)
        os.environ.update(LOCAL_RANK="0", GROUP_RANK=str(rank), LOCAL_WORLD_SIZE="1")
        yield f" (simulated: rank {rank} alone on node {rank}, LOCAL_RANK=0)", 0

    with restored_environ(*_NODE_ENV):
        yield each


def _expect(calls: dict[str, tuple[Any, Any]]) -> None:
    """`calls`: {'get(...)': (got, want)}; raise a Mismatch naming every call whose answer is wrong."""
    wrong = [f"{call} = {got!r}, expected {want!r}" for call, (got, want) in calls.items() if got != want]
    if wrong:
        raise Mismatch("; ".join(wrong))


@needs_process_group
def check_get(get: Callable[..., Any], timeout_s: float | None = None, quiet: bool = False) -> CheckResult:
    """`get(key, dm=None, mesh_dim=None)` for keys ws, rank, grank, lrank, pg: without a mesh, on a 1-D mesh,
    and on each dimension of a 2-D dp x tp mesh (named); without a mesh, and grank and lrank, also in a simulated
    multi-node job (LOCAL_RANK, GROUP_RANK and LOCAL_WORLD_SIZE set for the property only, as torchrun sets
    them when each node runs one process)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    dp1, dm = _meshes_for_this_group()

    def no_mesh() -> None:
        with _layouts(rank) as layouts:
            for where, _ in layouts():
                _expect({f'get("ws"){where}': (get("ws"), ws), f'get("rank"){where}': (get("rank"), rank),
                         f'get("pg") is the world group{where}': (get("pg") is dist.group.WORLD, True)})

    def one_dim() -> None:
        _expect({'get("ws", dp)': (get("ws", dp1), ws), 'get("rank", dp)': (get("rank", dp1), dp1.get_local_rank()),
                 'get("pg", dp) is its group': (get("pg", dp1) is dp1.get_group(), True)})

    def per_dimension() -> None:
        calls = {}
        for index, dim in enumerate(("dp", "tp")):  # by name, as the lessons do (the package takes indices too)
            calls[f'get("ws", dm, {dim!r})'] = (get("ws", dm, dim), dm.size(index))
            calls[f'get("rank", dm, {dim!r})'] = (get("rank", dm, dim), dm.get_local_rank(dim))
            calls[f'get("pg", dm, {dim!r}) is its group'] = (get("pg", dm, dim) is dm.get_group(dim), True)
        _expect(calls)

    def global_and_node() -> None:
        with _layouts(rank) as layouts:
            for where, local in layouts():
                _expect({f'get("grank", dm, "tp"){where}': (get("grank", dm, "tp"), rank),
                         f'get("grank"){where}': (get("grank"), rank),
                         f'get("lrank", dm, "tp"){where}': (get("lrank", dm, "tp"), local),
                         f'get("lrank"){where}': (get("lrank"), local)})

    props = [
        Property("no mesh: the world", no_mesh, "without dm: dist.get_world_size(), dist.get_rank(), dist.group.WORLD; "
                 "not LOCAL_WORLD_SIZE or LOCAL_RANK, which count one node only"),
        Property("1-D mesh: its group", one_dim, "dm.size(), dm.get_local_rank(), dm.get_group(): the mesh's group",
                 needs=("no mesh: the world",)),
        Property("2-D mesh: one group per dimension", per_dimension,
                 "answer for mesh_dim: dm[dim] is that dimension's 1-D mesh (.size(), .get_local_rank(), .get_group())",
                 needs=("1-D mesh: its group",)),
        Property("grank global, lrank node-local", global_and_node,
                 "grank ignores the mesh (dist.get_rank()); lrank is the LOCAL_RANK torchrun sets, whatever the mesh: "
                 "on one node they are equal, on node 1 of a job they are not"),
    ]
    return run_check("get() on a device mesh", props, timeout_s, learner_namespaces(get), quiet,
                     warm_up=False)  # no optimizer in the properties
