"""Lesson 00: who am I? `get()` on the default group or on one dimension of a DeviceMesh, and `cache_mesh`.

The launcher plumbing (backend, device, `init_distributed`) lives in `ddp_lib.devices`.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

VALID_KEYS = ("ws", "pg", "rank", "grank", "lrank")


class cache_mesh:
    """Decorator with state: remembers a registered DeviceMesh (and its dimension) and passes it when none is given."""

    def __init__(self, func):
        self.func = func
        self._mesh: DeviceMesh | None = None
        self._mesh_dim: int | str | None = None

    def __call__(self, key: str, dm: DeviceMesh | None = None, mesh_dim: int | str | None = None):
        if dm is None:  # the registered mesh, along its registered dimension unless the caller names one
            dm = self._mesh
            mesh_dim = self._mesh_dim if mesh_dim is None else mesh_dim
        return self.func(key, dm, mesh_dim)

    def register_mesh(self, mesh: DeviceMesh | None, mesh_dim: int | str | None = None) -> "cache_mesh":
        """Use `mesh` (along `mesh_dim`) whenever the caller passes none; None forgets it."""
        self._mesh, self._mesh_dim = mesh, mesh_dim
        return self


def _dim(dm: DeviceMesh, mesh_dim: int | str | None) -> int:
    """The index of the dimension to answer for: the only one of a 1-D mesh, else the one the caller names."""
    names = dm.mesh_dim_names or tuple(range(dm.ndim))
    if mesh_dim is None and dm.ndim > 1:
        raise ValueError(f"a {dm.ndim}-D mesh has one group per dimension: name one, e.g. "
                         f"get('ws', dm, mesh_dim={names[0]!r}) (dimensions: {names})")
    if isinstance(mesh_dim, str):
        if mesh_dim not in names:
            raise ValueError(f"mesh_dim={mesh_dim!r}: this mesh's dimensions are {names}")
        return names.index(mesh_dim)
    return 0 if mesh_dim is None else mesh_dim


@cache_mesh
def get(key: str, dm: DeviceMesh | None = None, mesh_dim: int | str | None = None):
    """Who am I? Without a mesh: `ws` world size, `rank` global rank, `pg` the world group. With a mesh, along
    `mesh_dim`: `ws` that dimension's group size, `rank` my rank in that group, `pg` that group. Always:
    `grank` the global rank, `lrank` the node-local rank (`LOCAL_RANK`, which picks the GPU)."""
    if key not in VALID_KEYS:
        raise ValueError(f"get({key!r}): unknown key; valid keys are {', '.join(VALID_KEYS)}")
    match key:
        case "grank":
            return dist.get_rank()  # names the process in the whole job, whatever the mesh
        case "lrank":
            return int(os.environ.get("LOCAL_RANK", 0))  # the mesh-local rank is get("rank", dm, dim)
    if dm is None:
        if mesh_dim is not None:
            raise ValueError(f"get({key!r}, mesh_dim={mesh_dim!r}) without a mesh: pass dm or register one")
        return {"ws": dist.get_world_size, "rank": dist.get_rank, "pg": lambda: dist.group.WORLD}[key]()
    dim = _dim(dm, mesh_dim)
    match key:
        case "ws":
            return dm.size(dim)
        case "rank":
            return dm.get_local_rank(dim)
        case "pg":
            return dm.get_group(dim)
