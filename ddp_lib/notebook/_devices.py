"""Which device each rank of `%dist_init` gets: GPUs 0..N-1 with NCCL when there are enough, else gloo on the CPU.

`plan_devices` is pure (the GPU count and NCCL availability are arguments), so the choice is tested
on a machine without GPUs; `visible_gpus` asks torch what this kernel can see.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
from dataclasses import dataclass

from IPython.core.error import UsageError


@dataclass(frozen=True)
class DevicePlan:
    """GPU ids (rank i on gpu_ids[i]) or None for the CPU, the backend, and a note to print (or None)."""

    gpu_ids: list[int] | None
    backend: str
    note: str | None = None


def plan_devices(n: int, gpu_spec: str | None, force_cpu: bool, visible: int, nccl: bool = True) -> DevicePlan:
    """The devices for `n` ranks.

    `-g 0,1` (gpu_spec) is used as given and must name n distinct visible GPUs (two ranks on one GPU
    make NCCL fail); `--cpu` (force_cpu) means gloo on the CPU; otherwise GPUs 0..n-1 and NCCL when
    at least n are visible, else gloo. `visible` is the number of GPUs this kernel sees.
    """
    if force_cpu and gpu_spec:
        raise UsageError("--cpu and --gpu-ids contradict each other: give one of them")
    if force_cpu:
        return DevicePlan(None, "gloo")
    if gpu_spec:
        try:
            ids = [int(x) for x in gpu_spec.strip("'\"").split(",") if x.strip()]
        except ValueError:
            raise UsageError("Invalid GPU IDs format. Use comma-separated integers (e.g., '0,1,3')") from None
        if visible == 0:
            return DevicePlan(None, "gloo", "⚠️  CUDA not available, GPU IDs will be ignored (gloo on the CPU)")
        bad = [g for g in ids if not 0 <= g < visible]
        if bad:
            raise UsageError(f"Invalid GPU IDs: {bad}; available: {list(range(visible))}")
        if len(set(ids[:n])) < n:
            raise UsageError(f"{n} ranks need {n} distinct GPU IDs (one GPU per rank under NCCL), got {ids}")
        if not nccl:
            raise UsageError("this torch build has no NCCL: run without --gpu-ids (gloo on the CPU)")
        return DevicePlan(ids[:n], "nccl")
    if visible >= n and nccl:
        return DevicePlan(list(range(n)), "nccl")
    return DevicePlan(None, "gloo", cpu_fallback_reason(n, visible, nccl))


def cpu_fallback_reason(n: int, visible: int, nccl: bool = True) -> str | None:
    """One line saying why `n` ranks compute on the CPU although this kernel sees `visible` GPUs (None: no GPU,
    nothing to explain). NCCL needs a GPU of its own per rank, so a 1-GPU box runs a 2-rank lesson on gloo."""
    if not visible:
        return None
    them = "it" if visible == 1 else "them"
    if not nccl:
        return (f"⚠️  this torch build has no NCCL: the {n} ranks compute on the CPU with gloo, and the "
                f"{visible} visible GPU(s) stay idle")
    # one GPU: -n 1 puts a single rank on it, which the lessons refuse (they compare ranks): say so, not only "-n 1"
    single = ", for one rank alone: the lessons need 2 ranks and run them as now" if visible == 1 else ""
    return (f"⚠️  only {visible} GPU(s) visible for {n} ranks: NCCL needs one GPU per rank, so the {n} ranks compute "
            f"on the CPU with gloo and the GPU(s) stay idle (%dist_init -n {visible} would use {them}{single}; "
            "--cpu hides this line)")


@functools.lru_cache(maxsize=1)
def _gpu_evidence() -> tuple[bool, tuple[str, ...]]:
    """(nvidia-smi on PATH, GPU device nodes: NVIDIA, ROCm, WSL2), looked for once per process: `%dist_init`
    asks twice (which GPUs torch sees, then why it sees none), and the machine does not change in between."""
    nodes = glob.glob("/dev/nvidia[0-9]*") + glob.glob("/dev/kfd") + glob.glob("/dev/dxg")
    return shutil.which("nvidia-smi") is not None, tuple(nodes)


def _no_gpu_in_sight() -> bool:
    """True when nothing on this machine can be a GPU torch would use: torch not yet imported (a simulated box
    imports it with ddp_lib), no NVIDIA or ROCm device node, no WSL2 GPU node, no nvidia-smi."""
    import sys

    has_smi, nodes = _gpu_evidence()
    return "torch" not in sys.modules and not nodes and not has_smi


def visible_gpus() -> int:
    """GPUs this process can use (0 without CUDA)."""
    if _no_gpu_in_sight():  # the kernel need not import torch (seconds, before any rank starts) to learn it
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_available() -> bool:
    """Whether this torch build has the NCCL backend."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_nccl_available()


def worker_visible_devices(gpu_ids: list[int] | None, parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for the ranks: `gpu_ids` index what the kernel sees, which may itself be a
    subset (the kernel started with CUDA_VISIBLE_DEVICES=2,3 sees them as 0,1); CPU ranks (None) see no GPU.

    CPU ranks on a GPU box (too few GPUs, or --cpu) must not reach CUDA: torch code that asks
    `torch.cuda.is_available()` would then act on their CPU device as on a GPU (PowerSGD's hook calls
    `torch.cuda.synchronize(device)` with it, torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py),
    and each rank would open a CUDA context on GPU 0 for nothing.
    """
    if gpu_ids is None:
        return ""
    if not parent:
        return ",".join(map(str, gpu_ids))
    entries = [e.strip() for e in parent.split(",")]
    return ",".join(entries[g] for g in gpu_ids)


def gpu_without_cuda_note(has_smi: bool | None = None, dev_nodes: list[str] | None = None) -> str | None:
    """A line when this machine has NVIDIA GPUs (nvidia-smi or /dev/nvidia*) that torch cannot use, naming the
    fix; None otherwise (no GPU, CUDA working, or GPUs hidden on purpose with CUDA_VISIBLE_DEVICES="")."""
    seen_smi, seen_nodes = _gpu_evidence()
    has_smi = seen_smi if has_smi is None else has_smi
    dev_nodes = [n for n in seen_nodes if n.startswith("/dev/nvidia")] if dev_nodes is None else dev_nodes
    if not (has_smi or dev_nodes):  # asked first: without a GPU in sight the kernel never imports torch
        return None
    import torch

    if torch.cuda.is_available() or os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return None
    seen = "nvidia-smi" if has_smi else ", ".join(sorted(dev_nodes)[:2])
    if torch.version.cuda is None:
        fix = (f"torch {torch.__version__} is a CPU-only build: reinstall the CUDA build "
               "(rm -rf .venv && make setup, without the CPU index in PIP_EXTRA)")
    else:
        fix = (f"torch {torch.__version__} (built for CUDA {torch.version.cuda}) cannot use this driver: update the "
               "NVIDIA driver to one that supports that CUDA (nvidia-smi shows the newest CUDA it supports), or "
               "install a torch built for an older CUDA (pip install torch --index-url "
               "https://download.pytorch.org/whl/cu126)")
    return f"⚠️  NVIDIA GPUs are present ({seen}) but torch.cuda.is_available() is False: {fix}. The ranks use the CPU."
