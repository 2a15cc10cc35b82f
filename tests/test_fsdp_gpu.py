"""FSDP on real GPUs (NCCL): equality with one process in fp32 and bf16 compute, peak memory below DDP's.
Marked `gpu`; skipped, with the reason, where there are too few GPUs (`make gpu-check` runs them)."""

from __future__ import annotations

import pytest
import torch

import fsdp_defect_cases as C
from ddp_lib.launch import spawn

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.gpu
one_gpu = pytest.mark.skipif(N_GPUS < 1, reason=f"needs a CUDA GPU; this machine has {N_GPUS}")
two_gpus = pytest.mark.skipif(N_GPUS < 2, reason=f"needs 2 CUDA GPUs (NCCL, one per rank); this machine has {N_GPUS}")


@one_gpu
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_fsdp_on_nccl_equals_one_process(dtype):
    ranks = spawn(C.gpu_train, world_size=min(2, N_GPUS), args=(dtype,), backend="nccl", timeout_s=300)
    for r in ranks:
        assert all(d.startswith("cuda") for d in r["devices"])
        assert r["diff"] < (1e-5 if dtype is None else 2e-2)


@two_gpus
def test_fsdp_peak_memory_below_ddp():
    for r in spawn(C.gpu_peak_memory, world_size=2, backend="nccl", timeout_s=300):
        assert r["FSDP"] < 0.75 * r["DDP"], r
