"""Lesson 06: how good a training run is: model FLOPs per token, tokens/s, MFU, and (on CUDA) a memory snapshot.

Model FLOPs follow PaLM's Appendix B (Chowdhery et al. 2022, arXiv:2204.02311), the convention nanoGPT's
`estimate_mfu` cites: a training token costs 6N (forward 2N, backward 4N) plus
12·L·H·Q·T for attention (QKᵀ and the weighted sum of V: 4·H·Q·T FLOPs per layer forward, twice that backward),
N the parameters that multiply activations, L layers, H query heads of size Q, T the sequence length.
Recomputation (activation checkpointing, flash attention's backward) is not counted: these are *model* FLOPs,
what the model needs, not what the hardware happened to run. MFU = model FLOPs per second / the peak.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import torch
import torch.nn as nn

# Dense peaks in TFLOP/s from NVIDIA's datasheets, whose tensor-core figures are printed "with sparsity": dense is
# half. H100 (SXM5, PCIe, NVL columns) and H200 (SXM, NVL): "NVIDIA H100 Tensor Core GPU" and "NVIDIA H200 Tensor Core
# GPU" datasheets, BF16 1,979 / 1,513 / 1,671 and 1,979 / 1,671 TFLOPS with sparsity, TF32 989 / 756 / 835 and
# 989 / 835 with sparsity, FP32 67 / 51 / 60 and 67 / 60. A100 (40 and 80 GB, SXM4 and PCIe alike): "NVIDIA A100 Tensor
# Core GPU" datasheet, BF16 312 dense (624 sparse), TF32 156 dense (312 sparse), FP32 19.5. L4: "NVIDIA L4 Tensor Core
# GPU" datasheet, BF16 and FP16 242 and TF32 120 with sparsity, FP32 30.3. T4: "single precision" and "mixed precision
# (FP16/FP32)"; it has no TF32 (sm_75). "tf32" is fp32 matmuls on tensor cores (torch.backends.cuda.matmul.allow_tf32).
# Only GPUs whose datasheet we could read are listed; others get no MFU, not a guess.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 1979 / 2, "fp16": 1979 / 2, "tf32": 989 / 2, "fp32": 67.0},
    "H100 PCIe": {"bf16": 1513 / 2, "fp16": 1513 / 2, "tf32": 756 / 2, "fp32": 51.0},
    "H100 NVL": {"bf16": 1671 / 2, "fp16": 1671 / 2, "tf32": 835 / 2, "fp32": 60.0},
    "H200 NVL": {"bf16": 1671 / 2, "fp16": 1671 / 2, "tf32": 835 / 2, "fp32": 60.0},
    "H200 SXM": {"bf16": 1979 / 2, "fp16": 1979 / 2, "tf32": 989 / 2, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L4": {"bf16": 242 / 2, "fp16": 242 / 2, "tf32": 120 / 2, "fp32": 30.3},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}
# what torch.cuda.get_device_name says for each, first match wins ("NVIDIA H100 80GB HBM3" is the SXM5 board,
# "NVIDIA H100 NVL" and "NVIDIA H200 NVL" the NVL ones, "NVIDIA H200" the SXM one, "NVIDIA A100-SXM4-40GB" or
# "NVIDIA A100 80GB PCIe" an A100, "NVIDIA L4"; " L4" with its space: no other name holds it)
_NAMES = {"H100 SXM": ("H100", "HBM3"), "H100 PCIe": ("H100", "PCIe"), "H100 NVL": ("H100", "NVL"),
          "H200 NVL": ("H200", "NVL"), "H200 SXM": ("H200",), "A100": ("A100",), "L4": (" L4",), "T4": ("T4",)}


def matmul_params(model: nn.Module) -> int:
    """N of the 6N rule: the weights of the linear layers (each multiplies every token's activations once).

    Embedding lookups multiply nothing; norms' gains and biases are elementwise (under 0.1 % of a transformer).
    A tied output layer is a Linear and counts: its matmul runs, whatever tensor holds its weight. GPT-2's
    projections are transformers' `Conv1D` (a Linear with its weight transposed) and count too.
    """
    return sum(m.weight.numel() for m in model.modules()
               if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D" and m.weight.dim() == 2)


def attention_shape(config: Any) -> tuple[int, int, int]:
    """(L, H, Q): layers, query heads and head size of a transformers config (Llama, GPT-2 and the like)."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    return layers, heads, getattr(config, "head_dim", None) or hidden // heads


def training_flops(model: nn.Module, shapes: Iterable[tuple[int, int]]) -> float:
    """Model FLOPs of forward + backward over micro-batches of token shape (batch, seq_len): PaLM's
    6N + 12·L·H·Q·T per token, with T each micro-batch's own (padded) length."""
    n = matmul_params(model)
    layers, heads, head_dim = attention_shape(model.config)
    return float(sum(b * t * (6 * n + 12 * layers * heads * head_dim * t) for b, t in shapes))


def cpu_matmul_peak(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` fp32 n×n GEMMs on this process's CPU threads (after one warm-up call):
    the rate this rank's matmuls can reach now, the CPU stand-in for a datasheet peak."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: thread pool and caches
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b  # the host clock is right here: a CPU matmul returns when it is done
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def gpu_datasheet_peak(device: torch.device | str, dtype: torch.dtype | str) -> tuple[float | None, str]:
    """(FLOP/s, what it is) of the GPU's dense datasheet peak for `dtype` (or "tf32": fp32 matmuls on tensor cores);
    (None, why) when we have no value."""
    name = torch.cuda.get_device_name(device)
    key = next((k for k, marks in _NAMES.items() if all(m in name for m in marks)), None)
    kinds = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    kind = dtype if isinstance(dtype, str) else kinds.get(dtype, str(dtype))
    peak = GPU_PEAK_TFLOPS.get(key, {}).get(kind) if key else None
    if peak is None:
        return None, f"no datasheet peak for {name} in {kind} in ddp_lib.apps.mfu.GPU_PEAK_TFLOPS"
    return peak * 1e12, f"{key} {kind} dense datasheet peak, {peak:.1f} TFLOP/s"


def bf16_native(device: torch.device | str) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively (CUDA sm_80 and up), and why not where it does not."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"{device.type} ranks: the lesson keeps CPU runs in fp32"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, (f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}: bf16 is emulated below sm_80 "
                       "(no bf16 tensor cores), so bf16 autocast stays off and the step runs in fp32")
    return True, f"sm_{major}{minor} has bf16 tensor cores"


def memory_timeline(snapshot: dict, device: int = 0) -> list[int]:
    """Bytes allocated after each allocator event of a `torch.cuda.memory._snapshot()`, relative to the start
    of the recording (an allocation adds its size; a completed free subtracts it)."""
    sign = {"alloc": 1, "free_completed": -1}
    level, out = 0, []
    for entry in snapshot["device_traces"][device]:
        if entry["action"] in sign:
            level += sign[entry["action"]] * entry["size"]
            out.append(level)
    return out


def snapshot_skip_reason(device: torch.device | str) -> str | None:
    """Why a CUDA memory snapshot cannot be taken on `device` here, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"the ranks compute on {device.type.upper()}, and only CUDA's caching allocator records a history "
                "(torch.cuda.memory._record_memory_history)")
    if not hasattr(torch._C, "_cuda_record_memory_history"):  # torch's CPU build, as under ddp_lib.gpusim
        return "this torch build has no CUDA caching allocator (a CPU build): there is no allocator history to record"
    return None
