"""Rank-side code of test_fsdp_habit.py's DCP cases: fully_shard model and AdamW saved by 4 ranks, loaded by 2."""

from __future__ import annotations

import torch
import torch.nn as nn

from ddp_lib.torch_fsdp import dcp as D
from ddp_lib.kit.models import ToyModel


def batches() -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 8, (8,), generator=g)) for _ in range(2)]


def writer(directory: str) -> dict:
    torch.manual_seed(0)
    model, opt = D.sharded_model(ToyModel, (nn.Linear,))
    D.train(model, opt, batches())
    D.save(model, opt, directory)
    saved = D.full_params(model)
    D.train(model, opt, batches()[:1])  # one more step: what a resumed run must reproduce
    return {"saved": saved, "next": D.full_params(model)}


def reader(directory: str) -> dict:
    torch.manual_seed(1)  # other weights, fresh optimizer: everything must come from the checkpoint
    model, opt = D.sharded_model(ToyModel, (nn.Linear,))
    fresh = D.full_params(model)
    D.load(model, opt, directory)
    loaded = D.full_params(model)
    D.train(model, opt, batches()[:1])
    return {"fresh": fresh, "loaded": loaded, "next": D.full_params(model),
            "adam_steps": sorted({float(s["step"]) for s in opt.state.values()})}
