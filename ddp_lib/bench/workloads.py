"""The models the DDP benchmark races on: toy MLP, many small parameters, MLPs, narrow normed blocks, transformer LMs,
SmolLM2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib.kit.models import LM_PRESETS, ManySmallParams, NormedBlocks, ToyModel, TransformerLM, lm_loss


@dataclass
class Workload:
    """A model factory, a global-batch factory (same generator, same batch on every rank) and a loss."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], tuple[torch.Tensor, ...]]  # (generator, global batch size)
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]
    default_batch: int
    bucket_mb: float = 25.0  # the bucket cap the race uses unless told otherwise
    first_bucket_mb: float | None = None  # the first bucket's cap (None: torch DDP's 1 MiB, capped by bucket_mb)
    tokens: Callable[[tuple[torch.Tensor, ...]], int] | None = None  # tokens a batch trains on (None: no tokens)


def _regression(in_dim: int, out_dim: int) -> Callable:
    def batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        # drawn on the CPU from a CPU generator (the same numbers on any machine), then sharded and moved
        return torch.randn(n, in_dim, generator=g, device="cpu"), torch.randn(n, out_dim, generator=g, device="cpu")
    return batch


def _mse(model: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.mse_loss(model(b[0]), b[1])


def _tokens(vocab: int, length: int) -> Callable:
    def batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        return (torch.randint(0, vocab, (n, length + 1), generator=g, device="cpu"),)
    return batch


def _smollm2() -> Workload:
    from ddp_lib.apps.smollm2 import random_smollm2  # optional: needs transformers

    model0 = random_smollm2("small")
    vocab = model0.config.vocab_size

    def batch(g: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(3, vocab, (n, 64), generator=g, device="cpu")  # no pad token inside: the last token classifies
        return ids, torch.randint(0, 2, (n,), generator=g, device="cpu")

    def loss(model: nn.Module, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return model(input_ids=b[0], labels=b[1]).loss

    return Workload("smollm2", lambda: random_smollm2("small"), batch, loss, 8, tokens=lambda b: b[0].numel())


def get_workload(name: str) -> Workload:
    """toy | many_small | mlp | blocks (lesson 05's) | mlp-wide | lm-<tiny|mini|small|medium|large|xl> | smollm2 (random-init SmolLM2 shape, if importable)."""
    if name == "toy":
        return Workload(name, lambda: ToyModel(32, 64, 8), _regression(32, 8), _mse, 64)
    if name == "many_small":  # 128 tensors of 16x16 or 16: pure per-call latency
        return Workload(name, lambda: ManySmallParams(16, 64), _regression(16, 16), _mse, 32)
    if name == "mlp":  # 7 x 512x512 linears (7 MiB of fp32 gradients in 14 tensors), 512 samples per rank: backward's
        # compute exceeds the communication on 2 gloo ranks (B > N·β); a 1 MiB cap (one weight) makes 7 buckets
        return Workload(name, lambda: ToyModel(512, 512, 512, depth=6), _regression(512, 512), _mse, 1024, 1.0)
    if name == "blocks":  # lesson 05: 32 residual Linear+LayerNorm blocks 160 wide, 3.2 MiB of gradients in 128 tensors
        # (96 of them 160 floats), 512 samples per rank: every call's fixed cost counts. Caps scaled to the model as
        # torch's are to a large one (1 MiB first, 25 MiB after): a 0.125 MiB first bucket, then 0.5 MiB ones
        return Workload(name, lambda: NormedBlocks(160, 32), _regression(160, 160), _mse, 1024, 0.5, 0.125)
    if name == "mlp-wide":  # 13 x 1024x1024 linears, 52 MB: communication-bound on 2 gloo ranks (N·β > B)
        return Workload(name, lambda: ToyModel(1024, 1024, 1024, depth=12), _regression(1024, 1024), _mse, 64)
    if name.startswith("lm-") and name[3:] in LM_PRESETS:
        cfg = LM_PRESETS[name[3:]]
        seq = min(cfg.context_length, 128)
        return Workload(name, lambda: TransformerLM(cfg), _tokens(cfg.vocab_size, seq), lambda m, b: lm_loss(m, b[0]), 8,
                        tokens=lambda b: b[0].shape[0] * (b[0].shape[1] - 1))  # the last token is only a target
    if name == "smollm2":
        return _smollm2()
    raise ValueError(f"unknown model {name!r}: toy, many_small, mlp, blocks, mlp-wide, lm-<{'|'.join(LM_PRESETS)}>, smollm2")


MODELS = ["toy", "many_small", "mlp", "blocks", "mlp-wide"] + [f"lm-{p}" for p in LM_PRESETS] + ["smollm2"]
