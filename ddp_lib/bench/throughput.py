"""Tokens (or samples) per second and model FLOPs utilisation (MFU) of each race variant.

What one step works on is the same for every variant (`step_work`: its tokens or samples and its model FLOPs, over all
ranks), and so is each rank's peak (`device_peak`); `throughput_columns` divides them by each variant's median step.
Model FLOPs count what the model needs, not what the hardware ran: for a transformer 6·N per token (forward 2N,
backward 4N; N its matmul weights, `ddp_lib.apps.mfu.matmul_params`; attention's own matmuls, a few per cent at the
race's 128 tokens, are left out), for the other workloads what torch's `FlopCounterMode` counts in one forward and
backward of the model built on the meta device (shapes only: nothing allocated, nothing computed). The peak is the
GPU's dense datasheet figure for how the race computes (TF32 tensor cores where `timing.tf32_matmuls` turned them on,
sm_80 and up; else FP32); a CPU has no datasheet peak, so MFU is '-' there, with the reason printed once.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from ddp_lib.apps.mfu import gpu_datasheet_peak, matmul_params

CPU_NO_PEAK = ("MFU '-': the ranks compute on a CPU, which has no datasheet peak (lesson 06 measures a CPU's matmul "
               "rate instead)")


_COUNTED: dict[tuple, float] = {}  # (workload name, batch shapes and dtypes) -> FLOPs: a lesson races one model often


def counted_flops(workload, batch: tuple[torch.Tensor, ...]) -> float:
    """FLOPs of one forward and backward (parameter gradients) of `workload`'s model on `batch`'s shapes, as torch's
    FlopCounterMode counts them, on the meta device (counted once per workload and shapes in a process)."""
    key = (workload.name, tuple((tuple(t.shape), t.dtype) for t in batch))
    if key not in _COUNTED:
        _COUNTED[key] = _count(workload, batch)
    return _COUNTED[key]


def _count(workload, batch: tuple[torch.Tensor, ...]) -> float:
    with torch.device("meta"):
        model = workload.build()
    shapes = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in batch)
    with FlopCounterMode(display=False) as counter:
        loss = workload.loss(model, shapes)
        torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
    return float(counter.get_total_flops())


def step_work(workload, model: nn.Module, batch: tuple[torch.Tensor, ...], world_size: int) -> dict:
    """What one step works on over all ranks, given this rank's shard `batch`: `samples_per_step`,
    `tokens_per_step` (None for a workload without tokens) and `flops_per_step` (model FLOPs)."""
    samples = batch[0].shape[0] * world_size
    if workload.tokens is not None:
        tokens = workload.tokens(batch) * world_size
        return dict(samples_per_step=samples, tokens_per_step=tokens, flops_per_step=6.0 * matmul_params(model) * tokens)
    return dict(samples_per_step=samples, tokens_per_step=None,
                flops_per_step=counted_flops(workload, batch) * world_size)


def device_peak(device: torch.device) -> tuple[float | None, str]:
    """(FLOP/s, what it is) of one rank's peak for the race's fp32 step, read while the race's settings are on;
    (None, why) on a CPU or a GPU without a datasheet entry."""
    if device.type != "cuda":
        return None, CPU_NO_PEAK
    tf32 = torch.backends.cuda.matmul.allow_tf32 and torch.cuda.get_device_capability(device)[0] >= 8
    peak, what = gpu_datasheet_peak(device, "tf32" if tf32 else torch.float32)
    return peak, what if peak else f"MFU '-': {what}"


def throughput_columns(rows: list[dict]) -> list[dict]:
    """Copies of the rows with `tokens_per_s` (None without tokens), `samples_per_s` and `mfu` (model FLOPs per second
    over the ranks' summed peak; None without a peak), each from the row's median step."""
    out = []
    for r in rows:
        step_s = r["step_ms"] / 1e3
        tokens, samples, peak = r.get("tokens_per_step"), r.get("samples_per_step"), r.get("peak_flops")
        mfu = r["flops_per_step"] / step_s / (peak * r["world_size"]) if peak and r.get("flops_per_step") else None
        out.append({**r, "tokens_per_s": tokens / step_s if tokens else None,
                    "samples_per_s": samples / step_s if samples else None, "mfu": mfu})
    return out


def rate_column(rows: list[dict]) -> tuple[str, str]:
    """(header, row key) of the rate the race reports: tokens/s where the workload has tokens, else samples/s."""
    return ("tok/s", "tokens_per_s") if any(r.get("tokens_per_step") for r in rows) else ("smp/s", "samples_per_s")
