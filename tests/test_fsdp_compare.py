"""Lesson 08's harnesses: memory per scheme shrinks as ZeRO promises; the step timeline is complete and ordered."""

from __future__ import annotations

import torch

from ddp_lib.bench.fsdp_compare import KINDS, TimedFSDP, memory_of, memory_table, time_step
from ddp_lib.launch import spawn
from ddp_lib.kit.models import ToyModel

WIDTH, DEPTH = 64, 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return ToyModel(WIDTH, WIDTH, WIDTH, depth=DEPTH)


def _batches(n: int = 2, batch: int = 8) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, WIDTH, generator=g), torch.randint(0, WIDTH, (batch,), generator=g)) for _ in range(n)]


def _measure() -> dict:
    mem = {s: memory_of(s, _model, _batches(), torch.device("cpu")) for s in ("DDP", "ZeRO-1", "FSDP")}
    timed = TimedFSDP(_model())
    x, y = _batches(1)[0]
    return {"mem": mem, "table": memory_table(mem), "step": time_step(timed, x, y, steps=2),
            "units": len(set(timed.units.values()))}


def test_memory_and_timeline_on_two_ranks():
    """FSDP holds about half of DDP's params/grads/optimizer; ZeRO-1 halves the optimizer only; timeline sane."""
    ranks = spawn(_measure, world_size=2, timeout_s=300)
    for r in ranks:
        mem = r["mem"]
        psi_bytes = sum(p.numel() for p in _model().parameters()) * 4
        assert mem["DDP"]["params"] == psi_bytes and mem["DDP"]["optim"] >= 2 * psi_bytes
        assert mem["ZeRO-1"]["optim"] < 0.6 * mem["DDP"]["optim"]
        assert mem["FSDP"]["params"] < 0.6 * psi_bytes
        assert mem["FSDP"]["optim"] < 0.6 * mem["DDP"]["optim"]
        assert 0 < mem["FSDP"]["gathered"] < psi_bytes  # never the whole model gathered at once
        assert sum(mem["FSDP"][k] for k in KINDS) < sum(mem["DDP"][k] for k in KINDS)
        assert "FSDP" in r["table"] and "%" in r["table"]
        step = r["step"]
        assert 0 < step["forward_ms"] <= step["step_ms"]
        kinds = [e[0] for e in step["events"]]
        assert kinds.count("forward") == r["units"] and kinds.count("reduce-scatter") >= 1
        assert all(a <= b for _, _, a, b in step["events"])
        assert 0 <= step["beside_ms"] <= step["gather_ms"]
