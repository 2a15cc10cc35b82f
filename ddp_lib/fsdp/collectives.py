"""FSDP's flat buffers and its three collectives: the all-gather, the reduce-scatter and HSDP's all-reduce across
replicas, with the mesh HSDP runs on.

A unit's parameters are sharded one by one, as in FSDP2: each flattened, zero-padded to a multiple of the world
size, this rank keeping chunk `rank`. The all-gather sends the concatenation of this rank's chunks; rank r's block
of its output holds every parameter's chunk r. `FlatLayout` does that arithmetic; the functions below launch the
collectives through `ddp_lib.comm` (counted in a tally, labelled for the profiler).

HSDP, hybrid sharding on a 2-D mesh (replicate x shard), as torch's `fully_shard(mesh=2-D)` does it. 4 ranks as a
(2, 2) mesh: each row is one shard group (the ranks that split the weights, FSDP inside a node), each column a
replicate group (the ranks holding the same shard, DDP across nodes):

    mesh = hsdp_mesh(2, 2)          rank:  0 1      shard groups:     {0, 1}, {2, 3}
                                           2 3      replicate groups: {0, 2}, {1, 3}

A gradient takes two collectives: a reduce-scatter inside the shard group (my chunk, summed over my replica), then
an all-reduce across the replicate group (summed over the replicas holding the same chunk); the average divides
by every rank, shard size x replicas. All-gathers stay inside the shard group. `FSDP(module, mesh=mesh)` does it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ddp_lib import comm
from ddp_lib.devices import comm_device
from ddp_lib.mesh import get

DIMS = ("replicate", "shard")  # torch's order: fully_shard reads dim 0 as replicate, dim 1 as shard


class FlatLayout:
    """Where each parameter of a unit sits in its flat buffers, on a rank of `world_size` ranks."""

    def __init__(self, shapes: list[torch.Size], rank: int, world_size: int):
        self.shapes, self.rank, self.ws = shapes, rank, world_size
        self.numels = [math.prod(s) for s in shapes]
        self.sizes = [math.ceil(n / world_size) for n in self.numels]  # per-rank chunk of each parameter
        self.offsets = [sum(self.sizes[:i]) for i in range(len(shapes))]
        self.size = sum(self.sizes)  # this rank's shard of the whole unit

    def chunk(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of parameter i's full tensor: flattened, zero-padded to ws x its chunk size."""
        size = self.sizes[i]
        return F.pad(full.reshape(-1), (0, size * self.ws - full.numel()))[self.rank * size:(self.rank + 1) * size]

    def unpack(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The full parameters from the all-gather output [ws * size]: views for one parameter, else copies."""
        rows = buf.view(self.ws, self.size)
        return [rows[:, o:o + s].reshape(-1)[:n].view(shape)  # reshape copies a column block (FSDP2's copy-out)
                for o, s, n, shape in zip(self.offsets, self.sizes, self.numels, self.shapes)]

    def grad_input(self, grads: tuple, idx: list[int], device: torch.device) -> torch.Tensor:
        """The reduce-scatter input [ws * chunks of `idx`] in fp32: each gradient padded into its column block."""
        total = sum(self.sizes[j] for j in idx)
        if len(idx) == 1:  # one column block: write straight into the flat buffer, no temporary
            flat = torch.zeros(self.ws * total, dtype=torch.float32, device=device)
            if (g := grads[idx[0]]) is not None:
                flat[:g.numel()] = g.reshape(-1)
            return flat
        flat = torch.zeros(self.ws, total, dtype=torch.float32, device=device)
        off = 0
        for j in idx:
            s = self.sizes[j]
            if (g := grads[j]) is not None:
                flat[:, off:off + s] = F.pad(g.reshape(-1).float(), (0, s * self.ws - g.numel())).view(self.ws, s)
            off += s
        return flat.view(-1)

    def chunks_of(self, out: torch.Tensor, idx: list[int]) -> list[torch.Tensor]:
        """The reduce-scatter output [chunks of `idx`] cut into one chunk per parameter of `idx`."""
        return list(out.split([self.sizes[j] for j in idx]))


def concat_chunks(shards: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """This rank's chunks, concatenated, in the dtype the all-gather moves."""
    if len(shards) == 1:
        return shards[0].detach().to(dtype)
    return torch.cat([s.detach().to(dtype) for s in shards])


# ---------------------------------------------------------------------- the three collectives
def all_gather(src: torch.Tensor, world_size: int, group, tally: comm.Tally | None, label: str,
               async_op: bool = True) -> tuple[torch.Tensor, object]:
    """(output [world_size * len(src)], work): every rank's `src`, rank r's at block r."""
    buf = torch.empty(src.numel() * world_size, dtype=src.dtype, device=src.device)
    work = comm.all_gather_into_tensor(buf, src, group, async_op=async_op, tally=tally, label=label)
    return buf, work


def reduce_scatter(flat: torch.Tensor, world_size: int, group, tally: comm.Tally | None,
                   label: str) -> tuple[torch.Tensor, object]:
    """(output [len(flat) / world_size], work): block `rank` of `flat`, summed over the ranks (async)."""
    out = torch.empty(flat.numel() // world_size, dtype=flat.dtype, device=flat.device)
    return out, comm.reduce_scatter_tensor(out, flat, group, async_op=True, tally=tally, label=label)


def all_reduce_replicas(chunk: torch.Tensor, replicate_group, tally: comm.Tally | None = None) -> torch.Tensor:
    """HSDP's second step, in place: the replicas holding the same chunk add theirs."""
    comm.all_reduce(chunk, replicate_group, tally=tally, label="ddp.fsdp.allreduce.replicas")
    return chunk


# ---------------------------------------------------------------------- HSDP's mesh
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
