"""A strict simulation of a GPU box on the CPU: ranks on `cuda:i` talking NCCL, computing on the CPU.

Activated in a process by `DDP_GPU_SIM=<profile>` (1xH100, 8xH100, 2xT4, 1xL4, 2xA100): `import ddp_lib` calls
`activate()` first thing, so every process that imports the package (the notebook kernel, each `%dist_init` rank,
each rank of `ddp_lib.launch.spawn`) sees the same box. `DDP_GPU_SIM_DRY=1` adds dry mode (`_dry`: real sizes, no
data behind large tensors, memory counted exactly); `DDP_GPU_SIM_NCCL2=1` adds torch 2.15's NCCL device rule
(`_nccl2`). See docs/gpu-simulation.md for what it catches and what it cannot.
"""

from __future__ import annotations

import os

from ddp_lib import GPU_SIM_DRY_ENV as DRY_ENV  # "1": dry mode (ddp_lib.gpusim._dry)
from ddp_lib import GPU_SIM_ENV as ENV

NCCL2_ENV = "DDP_GPU_SIM_NCCL2"  # "1": torch 2.15's NCCL device rule (ddp_lib.gpusim._nccl2)

_active: str | None = None


def active() -> str | None:
    """The profile simulated in this process (None: real hardware)."""
    return _active


def dry() -> bool:
    """Whether this process runs the simulation's dry mode (no data behind large GPU tensors: values read on the host
    are placeholders, so a check of values, such as an all-reduce's sum, must skip itself there)."""
    return _active is not None and os.environ.get(DRY_ENV) == "1"


def visible(profile, cuda_visible_devices: str | None):
    """The profile as this process sees it: CUDA_VISIBLE_DEVICES (as %dist_init sets for its ranks) keeps the GPUs
    it names that exist, renumbered from 0, as CUDA does; unset keeps all of them."""
    import dataclasses

    if cuda_visible_devices is None:
        return profile
    ids = []
    for part in cuda_visible_devices.split(","):
        if not part.strip().isdigit() or int(part) >= profile.count:
            break  # CUDA stops at the first invalid entry
        ids.append(int(part))
    return dataclasses.replace(profile, count=len(ids))


def activate(name: str | None = None) -> None:
    """Install the simulation of profile `name` (default: $DDP_GPU_SIM) in this process; idempotent."""
    global _active
    name = name or os.environ.get(ENV, "")
    if _active == name:
        return
    if _active is not None:
        raise RuntimeError(f"ddp_lib.gpusim: {_active} is already simulated in this process, cannot switch to {name}")
    from ddp_lib.gpusim import _guard
    from ddp_lib.gpusim._profiles import PROFILES

    if name not in PROFILES:
        raise ValueError(f"{ENV}={name!r}: unknown profile; known: {', '.join(PROFILES)}")
    profile = visible(PROFILES[name], os.environ.get("CUDA_VISIBLE_DEVICES"))
    _active = name
    if profile.count == 0:  # CUDA_VISIBLE_DEVICES="" hides the GPUs: a CPU process, as on the box
        from ddp_lib.gpusim import _peaks

        _peaks.start()  # its host memory counts in a dry run's peaks all the same (a gloo rank of a 1-GPU box)
        return
    if not _guard.cpu_build():
        raise RuntimeError(f"{ENV}: the simulation needs torch's CPU build (this torch is built for CUDA)")
    _guard.install(profile.count)  # before torch is imported
    import torch

    from ddp_lib.gpusim import _box, _cuda, _dry, _memory, _nccl, _patch, _peaks, _serial

    _dry.activate()
    _box.profile = profile
    for i in range(profile.count):
        _memory.capacity[i] = profile.total_memory
    _cuda.register_factories()
    _patch.patch_torch_cuda()
    _nccl.install()
    _serial.install()
    _peaks.start()
