"""Rank-side code of the teardown stress test: a tied-weights model under BucketedDDP, then the group torn down.

It is shaped like CS336 2025's DDP test (`test_DistributedDataParallelCPU[0.01-ToyModelWithTiedWeights]`): fresh
interpreters from `torch.multiprocessing.spawn`, a few steps, then `dist.barrier(); dist.destroy_process_group()`,
and the ranks end by returning (so interpreter shutdown, where a left-over thread aborts a process, runs too).
`python tests/teardown_cases.py RUNS` runs it RUNS times and prints how many runs lost a rank to a signal;
`python tests/teardown_cases.py --freed` says whether destroy_process_group() freed the group after an optimizer.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ddp_lib from this checkout

from ddp_lib.ddp import BucketedDDP  # noqa: E402
from exit_jobs import join_gloo, outcome, run_job, train_steps  # noqa: E402

STEPS = 5


class TiedToy(nn.Module):
    """fc4 uses fc2's weight (one parameter, two uses), between a LayerNorm and bias-free Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln = nn.Linear(10, 10, bias=False), nn.LayerNorm(10)
        self.fc2, self.fc3 = nn.Linear(10, 50, bias=False), nn.Linear(50, 10, bias=False)
        self.fc4, self.fc5 = nn.Linear(10, 50, bias=False), nn.Linear(50, 5, bias=False)
        self.fc4.weight = self.fc2.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.ln(self.fc1(x)))
        x = torch.relu(self.fc3(torch.relu(self.fc2(x))))
        return self.fc5(torch.relu(self.fc4(x)))


def rank_main(rank: int, world_size: int, port: int) -> None:
    join_gloo(rank, world_size, port)
    dist.barrier()
    torch.manual_seed(rank)
    ddp = BucketedDDP(TiedToy(), bucket_size_mb=0.01)
    train_steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), rank, STEPS, ddp.finish_gradient_synchronization)
    dist.barrier()
    dist.destroy_process_group()


def group_freed_after_optimizer() -> bool:
    """One rank: a group, then an optimizer built (it imports torch._dynamo), then destroy_process_group(): whether
    the default ProcessGroup object is gone (nothing keeps its gloo threads alive into interpreter shutdown). Its
    store is in memory (one rank needs no rendezvous), so no port can be taken from under it."""
    import gc
    import weakref

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = weakref.ref(dist.group.WORLD)
    torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    dist.destroy_process_group()
    gc.collect()
    return group() is None


def run_once() -> str:
    """One 2-rank job (tests/exit_jobs.py): "ok", or how it ended (a signal, a non-zero exit, an error)."""
    return outcome(*run_job(rank_main))


if __name__ == "__main__":
    if sys.argv[1:] == ["--freed"]:
        print("freed" if group_freed_after_optimizer() else "kept", flush=True)
        sys.exit(0)
    outcomes = []
    for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 30):
        outcomes.append(run_once())
        print(f"run {i + 1}: {outcomes[-1]}", flush=True)
    bad = [o for o in outcomes if o != "ok"]
    print(f"{len(outcomes)} runs, {len(bad)} failed: {bad}", flush=True)
