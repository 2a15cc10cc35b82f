"""Lesson 08: HSDP, hybrid sharding on a 2-D mesh (replicate x shard), as torch's `fully_shard(mesh=2-D)` does it.

4 ranks as a (2, 2) mesh: each row is one shard group (the ranks that split the weights between them, FSDP inside
a node), each column a replicate group (the ranks that hold the same shard, DDP across nodes):

    mesh = hsdp_mesh(2, 2)          rank:  0 1      shard groups:     {0, 1}, {2, 3}
                                           2 3      replicate groups: {0, 2}, {1, 3}

A gradient takes two collectives: a reduce-scatter inside the shard group (my chunk, summed over my replica), then
an all-reduce across the replicate group (summed over the replicas holding the same chunk); the average divides
by every rank, shard size x replicas. All-gathers stay inside the shard group. `FSDP(module, mesh=mesh)` does it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ddp_lib import comm
from ddp_lib.devices import comm_device
from ddp_lib.mesh import get

DIMS = ("replicate", "shard")  # torch's order: fully_shard reads dim 0 as replicate, dim 1 as shard


def hsdp_mesh(replicas: int, shard: int) -> DeviceMesh:
    """A (replicas, shard) mesh over every rank of the job, dimensions named "replicate" and "shard"."""
    return init_device_mesh(comm_device().type, (replicas, shard), mesh_dim_names=DIMS)


def hsdp_groups(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard group, replicate group) of this rank: one group per mesh dimension, through lesson 00's `get()`."""
    return get("pg", mesh, mesh_dim="shard"), get("pg", mesh, mesh_dim="replicate")


def fsdp_groups(process_group, mesh: DeviceMesh | None) -> tuple:
    """FSDP's (shard group, replicate group or None, sync group: the ranks replicated state is shared over)."""
    if mesh is None:
        return process_group, None, process_group
    if process_group is not None:
        raise ValueError("FSDP: pass mesh= (HSDP) or process_group=, not both")
    shard, replicate = hsdp_groups(mesh)  # shard along "shard", all-reduce along "replicate"
    return shard, replicate, None  # replicated parameters and buffers: the whole world


def reduce_gradient(flat: torch.Tensor, shard_group, replicate_group) -> torch.Tensor:
    """This rank's full (padded) gradient [shard size * n] -> its chunk [n], averaged over every rank of the mesh."""
    n_shard, n_replicas = dist.get_world_size(shard_group), dist.get_world_size(replicate_group)
    out = torch.empty(flat.numel() // n_shard, dtype=flat.dtype, device=flat.device)
    comm.reduce_scatter_tensor(out, flat, shard_group)  # 1. my chunk, summed over my shard group
    all_reduce_replicas(out, replicate_group)  # 2. summed over the replicas that hold the same chunk
    return out.div_(n_shard * n_replicas)  # the average over all ranks: each summed exactly once


def all_reduce_replicas(chunk: torch.Tensor, replicate_group, tally: comm.Tally | None = None) -> torch.Tensor:
    """Step 2 alone, in place: what `FSDP(mesh=...)` runs once a unit's reduce-scatter lands."""
    comm.all_reduce(chunk, replicate_group, tally=tally, label="ddp.fsdp.allreduce.replicas")
    return chunk
