"""What the lessons' GPU sizes need per rank, computed from the models themselves (built on the meta device,
so nothing is allocated): `python -m ddp_lib.course.gpu_needs [--ranks 2]` prints the README's table.

Memory is the model states a rank holds at its peak: fp32 weights, gradients, optimizer state and the
engine's communication buffers (activations come on top: `make gpu-check` measures the real peak).
Time is a lower bound per training step: 6 FLOPs per multiply-accumulate weight and token (forward and
backward) plus causal attention, at an H100 SXM's dense peak (`H100`); real steps are slower.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

GiB = 2**30
# NVIDIA H100 SXM5 datasheet, dense (no sparsity): FP32 on CUDA cores, TF32 and BF16 on tensor cores
H100 = {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12}


# the peak GiB of tensors one rank holds in each lesson's largest step at its real sizes (-n 2), planned on the
# meta device by ddp_lib.course.gpu_plan.PLANS and rounded up; the lessons pass it to `small_scale(need_gib=...)`
# (tests/test_gpu_plan.py re-plans them and checks each GPU profile). Not planned: lessons 00, 01 and 03, whose
# tensors stay near 2 GiB per rank or below (the table of docs/gpu.md), and 09. The dry runs check these plans
# (docs/gpu-simulation.md): 02's dry peak is above its plan by attention's saved score matrices (the CPU's math path,
# which a GPU's flash kernel does not keep), 04 and 07 are within theirs; 08 below. 05's includes BucketedDDP's rebuild,
# which allocates the new buckets while the old ones live (re-plan when that double allocation is fixed).
NEED_GIB = {"02": 30.0, "04": 17.0, "05": 28.0, "06": 10.0, "07": 34.0, "08": 13.4}
# lessons whose dry peak is above the meta plan: a rank's dry peak at the real sizes (ddp_lib.gpusim.run --dry,
# docs/gpu-simulation.md), which NEED_GIB covers instead. 08's cells keep their engines, models and the timeline's
# batch alive as notebook globals: 13.36 GiB on a simulated T4, where its largest single step plans 4.3; 05: 27.79 GiB
# on a simulated 8xH100 at -n 2, where the race's plan gives 22.5 (the difference not traced)
DRY_PEAK_GIB = {"05": 27.79, "08": 13.36}
# host memory per rank (GiB) a lesson's real sizes hold beside the GPU's, passed as `small_scale(host_gib=...)`: the
# largest resident memory of one process in a dry run at the real sizes (`make gpu-sim PROFILE=8xH100 DRY=1 FAST=1
# LESSONS=05`, peaks.json), rounded up; a real box adds its CUDA libraries' host memory. 05's race keeps its reference
# on the device and builds each model there (ddp_lib.bench.ddp_step), so a rank holds no copy of lm-xl on the host;
# 07's memory cell builds each model on its GPU too (0.48 GiB dry on 8xH100 at -n 8); 02 builds lm-xl on the CPU
# before `.to(device)`, one fp32 copy beside the process. 06's is torch.profiler's record:
# every profiled op becomes a Python FunctionEvent, and its accumulation profile (6 steps of 4 micro-batches) took a
# rank from 3.0 to 8.5 GiB (the packaged SmolLM2-135M that an offline box loads). Not measured on a real box: the dry
# run's meta dispatch records events of its own (PythonSubclass, prims), a GPU adds its kernels and launches
# 08's is rank 0's checkpoint cells (2.47 GiB dry on 8xH100 -n 2; rank 1 1.3): the full CPU state dict, a plain CPU
# model loading it and DCP's async staging copy, as on a box
HOST_NEED_GIB = {"02": 6.2, "05": 0.5, "06": 8.7, "07": 0.5, "08": 2.5}


@dataclass(frozen=True)
class Workload:
    """One lesson's model at its GPU size, what one step feeds it, and how it is trained."""

    lesson: str
    what: str
    build: Callable[[], nn.Module]
    samples: int  # per rank and step at 2 ranks
    seq: int  # tokens per sample (1 for the MLPs)
    optimizer_bytes: int = 0  # per parameter: 0 for plain SGD, 8 for AdamW (two fp32 moments)
    zero1: bool = False  # the optimizer state is sharded over the ranks
    buffer_bytes: int = 0  # per parameter: communication buffers beside the gradients (a flat copy, torch DDP's buckets)
    extra_copies: int = 0  # whole extra fp32 model copies alive (the race keeps the reference's final parameters)
    layers_dim: tuple[int, int] = (0, 0)  # (layers, width) for the attention term; (0, 0) without attention
    global_batch: bool = True  # the batch is split over the ranks (False: `samples` per rank whatever their number)


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """Build a model without allocating its weights."""
    with torch.device("meta"):
        return build()


def sizes(model: nn.Module) -> tuple[int, int]:
    """(parameters, weights of its Linear layers): a tied weight counts once in the first, per use in the second."""
    params = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return params, linear


def needs(w: Workload, ranks: int = 2) -> dict:
    """Model-state memory per rank (GiB) and the step-time lower bounds (ms) of one workload."""
    params, linear = sizes(on_meta(w.build))
    samples = max(1, w.samples * 2 // ranks) if w.global_batch else w.samples
    tokens = samples * w.seq
    layers, dim = w.layers_dim
    flops = 6 * linear * tokens + 12 * layers * dim * w.seq * tokens // 2  # causal: half the score matrix
    per_param = 4 + 4 + w.optimizer_bytes / (ranks if w.zero1 else 1) + w.buffer_bytes + 4 * w.extra_copies
    state = params * per_param  # fp32 weights and gradients (bf16 autocast keeps both in fp32), state, buffers
    return dict(lesson=w.lesson, what=w.what, params_M=params / 1e6, state_GiB=state / GiB, tokens=tokens,
                TFLOP=flops / 1e12, **{f"ms_{k}": flops / peak * 1e3 for k, peak in H100.items()})


def _lm(name: str) -> Callable[[], nn.Module]:
    from ddp_lib.kit.models import TransformerLM

    return lambda: TransformerLM(name)


def _mlp(**kw) -> Callable[[], nn.Module]:
    from ddp_lib.kit.models import ToyModel

    return lambda: ToyModel(**kw)


def _smollm2() -> nn.Module:
    from ddp_lib.apps.smollm2 import random_smollm2

    return random_smollm2("full")


def workloads() -> list[Workload]:
    """The lessons' GPU sizes, as their parameters cells set them (per rank at 2 ranks)."""
    from ddp_lib.kit.models import LM_PRESETS

    xl = LM_PRESETS["xl"]
    return [  # SGD without momentum unless said: weights and gradients only
        Workload("02", "MLP 1024-4096x4-1024, batch 1024", _mlp(in_dim=1024, hidden=4096, out_dim=1024, depth=4), 512, 1),
        Workload("02", "LM xl, batch 16 x 256 tokens", _lm("xl"), 8, 256, layers_dim=(xl.n_layers, xl.d_model)),
        Workload("03", "MLP 1024-8192x4-1024, batch 64", _mlp(in_dim=1024, hidden=8192, out_dim=1024, depth=4), 32, 1),
        # the race: the reference variant's final parameters (on the device) + one variant at a time (FlatDDP's copy or
        # torch DDP's buckets at most)
        Workload("05", "LM xl race, batch 8 x 128 tokens", _lm("xl"), 4, 128, buffer_bytes=4, extra_copies=1,
                 layers_dim=(xl.n_layers, xl.d_model)),
        Workload("06", "SmolLM2-360M AdamW, 16 pairs x 128 tokens per rank", _smollm2, 16, 128, optimizer_bytes=8,
                 layers_dim=(32, 960), global_batch=False),
        Workload("07", "LM xl AdamW, 2 x 128 tokens per rank", _lm("xl"), 2, 128, optimizer_bytes=8,
                 layers_dim=(xl.n_layers, xl.d_model), global_batch=False),
        Workload("07", "LM xl ZeRO-1 AdamW, 2 x 128 tokens per rank", _lm("xl"), 2, 128, optimizer_bytes=8, zero1=True,
                 layers_dim=(xl.n_layers, xl.d_model), global_batch=False),
    ]


def markdown(ranks: int = 2) -> str:
    """The table of the README's GPU section."""
    rows = [needs(w, ranks) for w in workloads()]
    out = ["| lesson | model and step | parameters | model states per rank | TFLOP per rank-step | "
           "≥ ms at FP32 / TF32 / BF16 peak |", "|---|---|---|---|---|---|"]
    out += [f"| {r['lesson']} | {r['what']} | {r['params_M']:,.0f} M | {r['state_GiB']:.1f} GiB | {r['TFLOP']:.2f} | "
            f"{r['ms_fp32']:.0f} / {r['ms_tf32']:.1f} / {r['ms_bf16']:.1f} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    """Print the table."""
    p = argparse.ArgumentParser(prog="python -m ddp_lib.course.gpu_needs", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="data-parallel ranks the global batch is split over")
    print(markdown(p.parse_args(argv).ranks))


if __name__ == "__main__":
    main()
