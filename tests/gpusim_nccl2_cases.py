"""Rank functions for tests/test_gpusim_nccl2.py, run where DDP_GPU_SIM=2xT4 and DDP_GPU_SIM_NCCL2=1 (torch 2.15's
NCCL device rule, ddp_lib.gpusim._nccl2). Each record says how a group got its device: {"origin", "device"}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from ddp_lib.gpusim import _nccl2
from ddp_lib.launch import free_port, spawn
from ddp_lib.mesh import get
from gpusim_cases import _error  # tests/ is this script's folder

DIST_INIT_CELL = """%%distributed
import json, os
from ddp_lib.gpusim import _nccl2
with open(os.path.join({tmp!r}, f"dist_init_{{dist.get_rank()}}.json"), "w") as f:
    json.dump({{"origin": _nccl2.device_origin(dist.group.WORLD), "device": str(dist.group.WORLD.bound_device_id)}}, f)
"""


def record(group) -> dict:
    """How `group` got its device under the rule, and which device."""
    return {"origin": _nccl2.device_origin(group), "device": str(group.bound_device_id)}


def _regroup(init) -> None:
    """Destroy the default group and call `init()` on a port rank 0 chose, told over the old group."""
    port = [free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    init()


def places() -> dict:
    """On each rank of `spawn(backend="nccl")`: the course's groups on GPUs, then groups made without device_id."""
    from ddp_lib import devices
    from ddp_lib.check.mesh_get import _meshes_for_this_group
    from ddp_lib.fsdp.collectives import hsdp_mesh
    from ddp_lib.notebook._export_prologue import init_from_launcher

    out = {"spawn": record(dist.group.WORLD), "meshes": {}}
    for name, mesh in zip(("dp", "dp_tp"), _meshes_for_this_group()):
        for dim in mesh.mesh_dim_names:
            out["meshes"][f"{name}/{dim}"] = record(get("pg", mesh, dim))
    hsdp = hsdp_mesh(1, dist.get_world_size())
    for dim in hsdp.mesh_dim_names:
        out["meshes"][f"hsdp/{dim}"] = record(get("pg", hsdp, dim))
    # the exported script's prologue, as torchrun starts it (spawn set torchrun's variables)
    _regroup(init_from_launcher)
    out["export"] = record(dist.group.WORLD)

    # a planted mistake: the course's own init_distributed with device_id dropped before it reaches torch
    real = dist.init_process_group

    def without_device_id(*args, **kwargs):
        kwargs.pop("device_id", None)
        return real(*args, **kwargs)

    dist.init_process_group = without_device_id
    try:
        _regroup(lambda: devices.init_distributed(backend="nccl"))
    finally:
        dist.init_process_group = real
    out["planted"] = record(dist.group.WORLD)
    # the rule on its own, under a gloo world (no bound device): a new NCCL group takes LOCAL_RANK's GPU; two ranks
    # with one LOCAL_RANK (a launcher that set it once for every rank) end on one GPU and NCCL refuses them
    _regroup(lambda: dist.init_process_group("gloo"))
    out["derived"] = record(dist.new_group(backend="nccl"))
    local = os.environ["LOCAL_RANK"]
    os.environ["LOCAL_RANK"] = "0"
    try:
        out["duplicate"] = _error(lambda: dist.new_group(backend="nccl"))
    finally:
        os.environ["LOCAL_RANK"] = local
    dist.barrier()  # the gloo world still works after the refusal
    return out


def main(tmp: str) -> None:
    """Every case, then one line `RESULT {...}`: the spawn ranks' records and %dist_init's."""
    ranks = spawn(places, world_size=2, backend="nccl", timeout_s=300)
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        for cell in ("%load_ext ddp_lib.notebook", "%dist_init -n 2", DIST_INIT_CELL.format(tmp=tmp)):
            result = shell.run_cell(cell)
            if not result.success:
                raise RuntimeError(f"{cell.splitlines()[0]} failed: {result.error_in_exec or result.error_before_exec}")
    finally:
        shell.run_cell("%dist_shutdown")
    dist_init = [json.loads((Path(tmp) / f"dist_init_{r}.json").read_text()) for r in range(2)]
    print("RESULT " + repr({"ranks": ranks, "dist_init": dist_init}), flush=True)
    sys.stdout.flush()
