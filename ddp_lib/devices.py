"""Lesson 00, under the hood: which backend, which device, and one helper that starts the process group.

The device is read from the process group itself (`dist.get_backend_config`: which backend serves which
device type), never from `get_backend() == "nccl"`: a group started with no backend reports "undefined",
one started with "cpu:gloo,cuda:nccl" reports that string, and both run their CUDA collectives on NCCL.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
from typing import Callable, TypeVar

import torch
import torch.distributed as dist

# the environment variable that starts ranks under ddp_lib.gpusim (simulated GPUs), which the launchers read too:
# named in the package root, which imports no torch, since the simulation installs itself before torch
from ddp_lib import GPU_SIM_ENV  # noqa: F401

F = TypeVar("F", bound=Callable)


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


def backend_map(backend: str) -> dict[str, str]:
    """{device type: backend} for a backend name or config: "nccl" -> {"cuda": "nccl"},
    "gloo" -> {"cpu": "gloo", "cuda": "gloo"}, "cpu:gloo,cuda:nccl" -> {"cpu": "gloo", "cuda": "nccl"}."""
    backend = str(backend).lower()
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(",") if part)
    # the device types torch registers for each backend name (gloo also takes CUDA tensors, via the host)
    capability = getattr(dist.Backend, "backend_capability", {"gloo": ["cpu", "cuda"], "nccl": ["cuda"]})
    if backend not in capability:
        raise ValueError(f"cannot tell the devices of backend {backend!r}: give one of {sorted(capability)} "
                         "or a config such as 'cpu:gloo,cuda:nccl'")
    return {device: backend for device in capability[backend]}


def group_backends(group=None) -> dict[str, str]:
    """{device type: backend} of an initialised group (default: the world), read from the group's config."""
    config = getattr(dist, "get_backend_config", None)  # torch >= 2.2; before it, the name is all there is
    return backend_map(config(group) if config else dist.get_backend(group))


def _on_gpu(backends: dict[str, str]) -> bool:
    # a rank computes on its GPU when CUDA tensors have a backend of their own (nccl beside gloo, or nccl
    # alone); one backend for both (gloo) is a CPU backend; a cuda entry without a visible GPU
    # (init_process_group() with no backend on a CUDA build, GPUs hidden) cannot be where this rank computes
    cuda, cpu = backends.get("cuda"), backends.get("cpu")
    return cuda is not None and (cpu is None or (cpu != cuda and torch.cuda.is_available()))


def rank_device(backend: str | None = None, local_rank: int | None = None) -> torch.device:
    """The device a rank computes on: its own GPU (cuda:LOCAL_RANK) when its group runs CUDA collectives on
    a GPU backend (nccl), else the CPU. `backend`: a name or config; None (or "undefined"): the default group's."""
    if backend in (None, "undefined"):
        backends = group_backends() if dist.is_initialized() else backend_map(pick_backend())
    else:
        backends = backend_map(backend)
    if _on_gpu(backends):
        return torch.device("cuda", _env_int("LOCAL_RANK", 0) if local_rank is None else local_rank)
    return torch.device("cpu")


def comm_device(group=None) -> torch.device:
    """The device the group's collectives run on: this rank's current GPU under a GPU backend, else the CPU."""
    if _on_gpu(group_backends(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ranks_use_cuda(group=None) -> bool:
    """Whether the ranks compute on GPUs: the group's communication device once initialised, else the device
    ranks started with no backend would pick. GPUs visible to ranks that communicate on the CPU do not count."""
    if dist.is_available() and dist.is_initialized():
        return comm_device(group).type == "cuda"
    return rank_device().type == "cuda"


def gpu_memory_gib(group=None) -> float | None:
    """Total memory of the GPU this rank's collectives run on, in GiB; None when they run on the CPU."""
    device = comm_device(group)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory / 2**30


def fits_gpu(need_gib: float, total_gib: float) -> bool:
    """Whether a step whose tensors peak at `need_gib` fits a GPU of `total_gib`: 1 GiB is left for the CUDA
    context and libraries' workspaces, and a tenth of the card for the caching allocator's fragmentation."""
    return need_gib + 1.0 <= 0.9 * total_gib


def host_available_gib() -> float | None:
    """MemAvailable of this machine in GiB (Linux's /proc/meminfo); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def release_host_heap() -> None:
    """Hand memory the process has freed back to the OS: collect cycles, then glibc's `malloc_trim(0)`. After a large
    transient (torch.profiler's events: GiB for a few profiled steps of an LLM), glibc keeps the freed heap resident;
    elsewhere (macOS, musl) only the collection runs."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def small_scale(group=None, need_gib: float = 0.0, host_gib: float = 0.0) -> bool:
    """The lessons' one scale switch: small models when `DDP_SMALL=1`, when the group's collectives run on the CPU
    (gloo), when this rank's GPU has too little memory for `need_gib` (the peak of the lesson's real sizes,
    from `ddp_lib.course.gpu_needs.NEED_GIB`), or the machine too little for `host_gib` per local rank
    (`HOST_NEED_GIB`); the real sizes otherwise. Decided by memory, never by a backend. A choice made for memory
    is said in one line, by rank 0."""
    if os.environ.get("DDP_SMALL") == "1":
        return True
    total = gpu_memory_gib(group)
    if total is None:
        return True
    why = None
    if not fits_gpu(need_gib, total):
        why = f"need {need_gib:g} GiB of tensors per GPU (planned), this GPU has {total:.1f} GiB"
    host = host_available_gib() if host_gib else None
    ranks = _env_int("LOCAL_WORLD_SIZE", 1)
    if why is None and host is not None and host_gib * ranks > 0.9 * host:
        why = f"need {host_gib:g} GiB of host memory per rank x {ranks} ranks, this machine has {host:.0f} GiB free"
    if why is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"small sizes: this lesson's real sizes {why}")
    return why is not None


def require_ranks(world_size: int, minimum: int = 2) -> None:
    """Refuse clearly, with what to do, a lesson that compares ranks when fewer than `minimum` run it."""
    if world_size < minimum:
        raise RuntimeError(
            f"this lesson compares ranks and needs at least {minimum}, but {world_size} run it: %dist_shutdown, then "
            f"%dist_init -n {minimum} (a box with fewer GPUs than ranks runs them on the CPU with gloo, and says so)")


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

    `backend`: "gloo", "nccl", a config such as "cpu:gloo,cuda:nccl", or None/"auto" for `pick_backend()`.
    A finite timeout turns a rank that never arrives, or a collective that one rank skips,
    into an error instead of a hang (under nccl torch's watchdog ends the rank after
    `timeout_s` with a message naming the collective, e.g. `OpType=ALLREDUCE`).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), rank_device()
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        raise RuntimeError("init_distributed: set MASTER_PORT (torchrun and ddp_lib.launch do it for you)")
    if backend in (None, "auto"):
        backend = pick_backend(_env_int("LOCAL_WORLD_SIZE", world_size))
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


def require_process_group(what: str = "this") -> None:
    """Raise a clear error, naming `what` and the cells or call that start the ranks, when no group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"torch.distributed is not initialised in this process, and {what} needs a process group. In a notebook, "
            "run the lesson's first cells (%load_ext ddp_lib.notebook, then %dist_init); after a kernel restart the "
            "ranks and everything the earlier cells defined are gone, so run the cells above this one again first. "
            "In a script, call ddp_lib.devices.init_distributed() first (torchrun sets the ranks' environment, not "
            "the group)."
        )


def needs_process_group(fn: F) -> F:
    """`fn` raises require_process_group's error, naming itself, before it reaches torch.distributed: a check cell run
    in a restarted kernel (no ranks) says what to run instead of torch's "Default process group has not been
    initialized"."""

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        require_process_group(f"{fn.__name__}()")
        return fn(*args, **kwargs)

    return guarded  # type: ignore[return-value]
