"""Rank functions for tests/test_gpusim.py: they run in processes where DDP_GPU_SIM is set (a simulated GPU box).

Imported by name in the ranks (the test puts tests/ on PYTHONPATH), so `ddp_lib.launch.spawn` can start them.
"""

from __future__ import annotations

import io
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.launch import spawn
from ddp_lib.models import ToyModel

STEPS, BATCH = 4, 8


def _batches(device):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 32, generator=g).to(device), torch.randint(0, 8, (BATCH,), generator=g).to(device))
            for _ in range(STEPS)]


def train(engine: str | None) -> list[float]:
    """Train ToyModel with `engine` on this rank's GPU (None: one process on the CPU, the full batch)."""
    from ddp_lib.ddp import BucketedDDP, NaiveDDP
    from ddp_lib.fsdp import FSDP

    torch.manual_seed(0)
    device = torch.device("cuda", dist.get_rank()) if engine else torch.device("cpu")
    model = ToyModel().to(device)
    rank, ws = (dist.get_rank(), dist.get_world_size()) if engine else (0, 1)
    wrap = {"naive": NaiveDDP, "bucketed": BucketedDDP, "fsdp": FSDP,
            "torch": lambda m: torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank])}
    wrapped = wrap[engine](model) if engine else model
    opt = torch.optim.SGD(wrapped.parameters() if engine == "fsdp" else model.parameters(), lr=0.1)
    for x, y in _batches(device):
        n = BATCH // ws
        loss = F.cross_entropy(wrapped(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        opt.zero_grad()
        loss.backward()
        if engine not in (None, "torch"):
            wrapped.finish_gradient_synchronization()
        opt.step()
    if engine == "fsdp":
        state = wrapped.gather_full_params()
        assert all(v.device == device for v in state.values()), {k: v.device for k, v in state.items()}
        return torch.cat([state[k].cpu().flatten() for k, _ in model.named_parameters()]).tolist()
    assert all(p.device == device for p in model.parameters()), [p.device for p in model.parameters()]
    return torch.cat([p.detach().cpu().flatten() for p in model.parameters()]).tolist()


def engines(names: list[str]) -> dict:
    """Every engine in `names`, trained in turn on the simulated NCCL group."""
    return {name: train(name) for name in names}


def main(case: str) -> None:
    """Run one case on 2 ranks under NCCL-sim; print its result as the last line."""
    try:
        if case == "engines":
            ref = train(None)
            out = spawn(engines, 2, args=(["naive", "bucketed", "fsdp", "torch"],), backend="nccl")[0]
            print({k: max(abs(a - b) for a, b in zip(v, ref)) for k, v in out.items()})
        else:
            print(spawn(globals()[case], 2, backend="nccl"))
    except Exception as e:  # noqa: BLE001 - the test reads the error's text
        traceback.print_exc()
        print("ERROR", type(e).__name__, str(e).replace("\n", " ")[:2000])


if __name__ == "__main__":
    main(sys.argv[1])
