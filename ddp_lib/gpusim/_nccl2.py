"""torch 2.15's NCCL device rule, simulated on the pinned torch when `DDP_GPU_SIM_NCCL2=1`.

In torch 2.15 `backend="nccl"` builds ProcessGroupNCCL2 (`_register_builtin_nccl_backend`,
torch/distributed/distributed_c10d.py lines 961-984; `TORCH_DIST_USE_NCCL2=0` keeps the old one). Its device
(`_nccl2_device`, lines 820-849) is the group's bound device when `init_process_group(device_id=...)` gave one
(`pg.bound_device_id`, set at line 3054 and read at lines 826-829); otherwise `LOCAL_RANK % device_count()`, or,
without LOCAL_RANK, the rank's global rank modulo the count (lines 835-843), bound to the group either way (lines
846-847). The communicator then starts at once on that device, and NCCL refuses two ranks of one communicator on one
GPU when it starts ("Duplicate GPU detected", NCCL's wording as torch users report it; the bundled libnccl.so.2 2.30.7
holds no such plain string, so the text here is that report's, not read from 2.15's build). Here every simulated NCCL
group made under the rule binds its device the same way, and its ranks compare (host, physical GPU) through the
group's store.
"""

from __future__ import annotations

import os
import socket

import torch

from ddp_lib.gpusim import NCCL2_ENV

ORIGIN = "_ddp_gpusim_device_from"  # how a simulated NCCL group got its device: "device_id", "LOCAL_RANK" or "rank"


def enabled() -> bool:
    """Whether this process simulates 2.15's rule (`TORCH_DIST_USE_NCCL2=0` chooses the old group there too)."""
    return os.environ.get(NCCL2_ENV) == "1" and os.environ.get("TORCH_DIST_USE_NCCL2") != "0"


def derived_device(group_rank: int, global_ranks: list[int] | None) -> tuple[torch.device, str]:
    """The device `_nccl2_device` picks without `device_id`, and what it was picked from."""
    count = torch.cuda.device_count()
    if "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]) % count), "LOCAL_RANK"
    rank = global_ranks[group_rank] if global_ranks else group_rank
    return torch.device("cuda", rank % count), "rank"


def physical_gpu(index: int) -> str:
    """The GPU behind `cuda:index` as the box numbers it (CUDA_VISIBLE_DEVICES renumbers what a process sees)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def bind(pg, group_rank: int, global_ranks: list[int] | None) -> None:
    """Give a new simulated NCCL group its device as 2.15 does, then refuse two of its ranks on one GPU."""
    if pg.bound_device_id is not None:
        setattr(pg, ORIGIN, "device_id")
    else:
        device, origin = derived_device(group_rank, global_ranks)
        pg.bound_device_id = device
        setattr(pg, ORIGIN, origin)
    store, me = pg.get_group_store(), pg.rank()
    key = "ddp_gpusim_nccl2/gpu/{}"
    store.set(key.format(me), f"{socket.gethostname()}/{physical_gpu(pg.bound_device_id.index)}")
    seen: dict[str, int] = {}
    for r in range(pg.size()):
        where = store.get(key.format(r)).decode()
        if where in seen:
            raise torch.distributed.DistBackendError(
                f"NCCL error: invalid usage (ncclInvalidUsage). Last error:\nDuplicate GPU detected : rank {r} and "
                f"rank {seen[where]} both on CUDA device {where.rsplit('/', 1)[1]} (ddp_lib.gpusim, torch 2.15's rule: "
                f"this rank's group took {pg.bound_device_id} from {getattr(pg, ORIGIN)}; pass "
                "init_process_group(device_id=...))")
        seen[where] = r


def device_origin(group) -> str | None:
    """How a simulated NCCL group got its device under the rule ("device_id", "LOCAL_RANK", "rank"); None for a
    group the rule did not bind (gloo, or the rule off)."""
    return getattr(group, ORIGIN, None)
