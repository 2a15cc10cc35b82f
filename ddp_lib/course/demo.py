"""A one-minute tour: every DDP engine trains the same model on 2 gloo ranks (CPU) and matches one process.

The model stays on the CPU, so the ranks use gloo even on a GPU box (nccl would reject CPU tensors).

    python -m ddp_lib.course.demo
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.kit.data import shard_batch
from ddp_lib.ddp import ENGINES
from ddp_lib.launch import spawn
from ddp_lib.kit.models import ToyModel

STEPS, BATCH = 20, 16


def _batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 32, generator=g), torch.randint(0, 8, (BATCH,), generator=g)) for _ in range(STEPS)]


def _train(engine: str | None) -> tuple[list[float], torch.Tensor, int]:
    """Train with `engine` on the current process group (None: one process, full batch)."""
    torch.manual_seed(0)
    model = ToyModel()
    rank, ws = (dist.get_rank(), dist.get_world_size()) if engine else (0, 1)
    wrapped = ENGINES[engine](model) if engine else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():
        loss = F.cross_entropy(wrapped(shard_batch(x, rank, ws)), shard_batch(y, rank, ws))
        opt.zero_grad()
        loss.backward()
        if engine:
            wrapped.finish_gradient_synchronization()
        opt.step()
        losses.append(loss.item())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return losses, flat, getattr(wrapped, "comm_calls", 0)


def _all_engines() -> dict:
    return {name: _train(name) for name in ENGINES}


def main() -> int:
    """Run the tour and print how far each engine's parameters are from single-process training."""
    ref_losses, ref_params, _ = _train(None)
    results = spawn(_all_engines, world_size=2, backend="gloo")
    print("2 ranks, gloo on the CPU")
    print(f"single process, batch {BATCH}: loss {ref_losses[0]:.4f} -> {ref_losses[-1]:.4f} in {STEPS} SGD steps")
    print(f"{'engine':<10}{'comm calls/step':>16}{'max |param - single|':>24}")
    worst = 0.0
    for name in ENGINES:
        diff = max((r[name][1] - ref_params).abs().max().item() for r in results)
        worst = max(worst, diff)
        print(f"{name:<10}{results[0][name][2]:>16}{diff:>24.2e}")
    ok = worst < 1e-5
    print("every engine matches single-process training" if ok else "MISMATCH beyond 1e-5")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
