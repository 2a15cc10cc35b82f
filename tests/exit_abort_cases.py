"""Rank-side code of the exit-abort reproducer, shaped like CS336 2025's DDP tests.

Each job: `torch.multiprocessing` starts 2 fresh interpreters (spawn) on a free port, each joins a gloo group,
trains a few steps with every engine in turn behind a small adapter (the shape of CS336's `adapters.py`: wrap,
`on_train_batch_start`, `on_after_backward`), then `dist.barrier(); dist.destroy_process_group()` and returns, so
interpreter shutdown runs; each rank's exit code is read (a negative one is a signal: -6 is SIGABRT, "terminate
called without an active exception"). `--torch` trains torch's DistributedDataParallel alone instead;
`--group` hands the engines a `dist.new_group()` instead of the default group.

`python tests/exit_abort_cases.py RUNS [--torch] [--group] [--load]` prints each job's exit codes and a summary;
`--load` runs two busy processes beside the jobs (started here and ended by PID).
`python tests/exit_abort_cases.py --freed [--group]` prints, per engine and for lesson 08's FSDP (flat and HSDP on a
1 x 1 mesh), whether `destroy_process_group()` freed the group while the wrapper still exists.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # ddp_lib from this checkout

from ddp_lib.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP  # noqa: E402
from ddp_lib.fsdp import FSDP  # noqa: E402
from ddp_lib.fsdp.collectives import hsdp_groups, hsdp_mesh  # noqa: E402
from exit_jobs import join_gloo, run_job, train_steps  # noqa: E402

STEPS = 3
ENGINES = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP,
           "bucketed": lambda m, **kw: BucketedDDP(m, bucket_size_mb=0.01, **kw)}
# the wrappers whose hold on the group --freed checks: the engines, and FSDP on a given group or on an HSDP mesh (whose
# shard and replicate groups it holds); the loaded jobs train the engines only
HOLDERS = [*ENGINES, "fsdp", "hsdp"]


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(10, 50, bias=False), nn.LayerNorm(50), nn.Linear(50, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.ln(self.fc1(x))))


# the adapter, as CS336's tests reach an engine
def get_ddp(module: nn.Module, engine: str, group=None) -> nn.Module:
    if engine == "torch":
        return nn.parallel.DistributedDataParallel(module, process_group=group)
    if engine == "fsdp":
        return FSDP(module, **({"process_group": group} if group is not None else {}))
    return ENGINES[engine](module, **({"process_group": group} if group is not None else {}))


def on_after_backward(ddp: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if hasattr(ddp, "finish_gradient_synchronization"):
        ddp.finish_gradient_synchronization()


def train(engine: str, rank: int, group) -> None:
    torch.manual_seed(rank)
    ddp = get_ddp(Toy(), engine, group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    train_steps(ddp, opt, rank, STEPS, lambda: on_after_backward(ddp, opt))


def rank_main(rank: int, world_size: int, port: int, engines: list[str], new_group: bool) -> None:
    join_gloo(rank, world_size, port)
    group = dist.new_group() if new_group else None
    for engine in engines:
        train(engine, rank, group)
    dist.barrier()
    dist.destroy_process_group()


def run_once(engines: list[str], new_group: bool) -> list[int]:
    """One 2-rank job (tests/exit_jobs.py): each rank's exit code (0, 1 for a raised exception, -signal for a
    signal, -9 for a hung rank ended by its PID)."""
    return run_job(rank_main, (engines, new_group))[0]


@contextlib.contextmanager
def cpu_load(n: int = 2):
    """`n` busy Python processes for the duration, ended by their PIDs."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield [p.pid for p in busy]
    finally:
        for p in busy:
            p.kill()
            p.wait()


def freed(engine: str, new_group: bool) -> bool:
    """One rank: an engine trained, destroy_process_group(), the engine kept: whether its group was freed."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.new_group([0]) if new_group else None
    refs = [weakref.ref(group if group is not None else dist.group.WORLD)]
    if engine == "hsdp":
        mesh = hsdp_mesh(1, 1)
        refs = [weakref.ref(g) for g in hsdp_groups(mesh)]
        ddp = FSDP(Toy(), mesh=mesh)
        del mesh
    else:
        ddp = get_ddp(Toy(), engine, group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.randn(4, 10)).sum().backward()
        on_after_backward(ddp, opt)
        opt.step()
    del group
    dist.destroy_process_group()
    gc.collect()
    alive = any(ref() is not None for ref in refs)
    del ddp, opt  # kept until here: the question is whether the engine holds the group
    return not alive


def main(argv: list[str]) -> int:
    new_group = "--group" in argv
    if "--freed" in argv:
        for engine in HOLDERS:
            print(engine, "freed" if freed(engine, new_group) else "kept", flush=True)
        return 0
    runs = int(argv[0]) if argv and argv[0].isdigit() else 30
    engines = ["torch"] if "--torch" in argv else list(ENGINES)
    with cpu_load() if "--load" in argv else contextlib.nullcontext():
        codes = []
        for i in range(runs):
            codes.append(run_once(engines, new_group))
            print(f"run {i + 1}: exit codes {codes[-1]}", flush=True)
    bad = [c for c in codes if any(code != 0 for code in c)]
    aborts = sum(code == -6 for c in codes for code in c)
    print(f"{runs} runs, {len(bad)} failed, {aborts} ranks aborted (SIGABRT): {bad}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
