"""Lesson 00: who am I? `get()` with `cache_mesh`, and one helper that starts the process group."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

VALID_KEYS = ("ws", "pg", "rank", "grank", "lrank")


class cache_mesh:
    """Decorator with state: remembers a registered DeviceMesh and passes it when none is given."""

    def __init__(self, func):
        self.func = func
        self._mesh: DeviceMesh | None = None

    def __call__(self, key: str, dm: DeviceMesh | None = None):
        mesh = self._mesh if dm is None else dm
        return self.func(key, mesh)

    def register_mesh(self, mesh: DeviceMesh | None) -> "cache_mesh":
        """Use `mesh` whenever the caller passes none (None forgets it)."""
        self._mesh = mesh
        return self


@cache_mesh
def get(key: str, dm: DeviceMesh | None = None):
    """Look up `ws` (world size), `pg` (process group), `rank`/`grank` (global rank), `lrank` (local rank)."""
    if key not in VALID_KEYS:
        raise ValueError(f"get({key!r}): unknown key; valid keys are {', '.join(VALID_KEYS)}")
    pg = dm.get_group() if dm is not None else None
    match key:
        case "ws":
            return dist.get_world_size(pg)
        case "pg":
            return pg if pg is not None else dist.group.WORLD
        case "rank" | "grank":
            return dist.get_rank()  # global rank, whatever the mesh
        case "lrank":
            return dm.get_local_rank() if dm is not None else int(os.environ.get("LOCAL_RANK", 0))


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def pick_backend(local_world_size: int | None = None) -> str:
    """nccl when every rank on this node can have a GPU of its own, gloo otherwise (CPU, or more ranks than GPUs).

    Counted per node: `LOCAL_WORLD_SIZE` (torchrun's --nproc-per-node), not the global `WORLD_SIZE`,
    which a 2-node x 8-GPU job would compare with 8 GPUs and wrongly fall back to gloo.
    """
    lws = local_world_size if local_world_size is not None else _env_int(
        "LOCAL_WORLD_SIZE", _env_int("WORLD_SIZE", 1))  # no LOCAL_WORLD_SIZE: assume one node
    if torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= lws:
        return "nccl"
    return "gloo"


def rank_device(backend: str, local_rank: int | None = None) -> torch.device:
    """The device a rank computes on: its own GPU (cuda:LOCAL_RANK) under nccl, the CPU under gloo."""
    if backend == "nccl":
        return torch.device("cuda", _env_int("LOCAL_RANK", 0) if local_rank is None else local_rank)
    return torch.device("cpu")


def comm_device(group=None) -> torch.device:
    """The device the group's collectives run on: this rank's current GPU under nccl, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_gpu_for_rank(rank: int, local_rank: int) -> None:
    """Raise a clear error, naming the rank, when an nccl rank has no GPU of its own on this node."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count:
        seen = f"{count} GPU(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
        raise RuntimeError(
            f"rank {rank} (local rank {local_rank} on {socket.gethostname()}) has no GPU for the nccl backend: "
            f"this node sees {seen}. Start at most {count} ranks per node (torchrun --nproc-per-node), "
            "or use backend='gloo' to compute on the CPU")


def init_distributed(
    backend: str | None = None,
    timeout_s: float = 120.0,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[int, int, torch.device]:
    """Start the default process group from env:// (torchrun-compatible); return (rank, world_size, device).

    A finite timeout turns a rank that never arrives, or a collective that one rank skips,
    into an error instead of a hang (under nccl torch's watchdog ends the rank after
    `timeout_s` with a message naming the collective, e.g. `OpType=ALLREDUCE`).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), rank_device(dist.get_backend())
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        raise RuntimeError("init_distributed: set MASTER_PORT (torchrun and ddp_lib.launch do it for you)")
    backend = backend or pick_backend(_env_int("LOCAL_WORLD_SIZE", world_size))
    device = rank_device(backend)
    if device.type == "cuda":
        check_gpu_for_rank(rank, device.index)
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    return rank, world_size, device


def require_process_group() -> None:
    """Raise a clear error when no process group has been initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialised: call ddp_lib.mesh.init_distributed() "
            "(or run under %dist_init / torchrun) before wrapping a model"
        )
