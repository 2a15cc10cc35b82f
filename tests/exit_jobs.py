"""The spawn harness of the exit-time reproducers (tests/teardown_cases.py, tests/exit_abort_cases.py), shaped like
CS336 2025's DDP tests: `torch.multiprocessing` starts fresh interpreters (spawn) on a free port, each joins a gloo
group, trains a few steps, then `dist.barrier(); dist.destroy_process_group()` and returns, so interpreter shutdown
runs. Each rank's exit code is read: a negative one is a signal (-6 is SIGABRT, "terminate called without an active
exception")."""

from __future__ import annotations

import os
import pickle
import signal
import time
from multiprocessing.connection import wait
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from ddp_lib.launch import free_port


def join_gloo(rank: int, world_size: int, port: int) -> None:
    """This rank joins the job's gloo group through rank 0's store on `port`, one compute thread per rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def train_steps(ddp: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int,
                after_backward: Callable[[], None]) -> None:
    """`steps` steps on this rank's half of a batch of 20 (10 features in, 5 out), the same batches on every rank."""
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(20, 10, generator=g), torch.randn(20, 5, generator=g)
        part = slice(rank * 10, (rank + 1) * 10)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[part]), y[part]).backward()
        after_backward()
        opt.step()


def run_job(rank_main: Callable, args: tuple = (), nprocs: int = 2, timeout_s: float = 300, grace_s: float = 10,
            tries: int = 3) -> tuple[list[int], list[str]]:
    """One job: `rank_main(rank, nprocs, port, *args)` in `nprocs` spawned interpreters; each rank's exit code and
    the traceback of each rank that raised ("" for the others).

    A rank still running `timeout_s` after the start, or `grace_s` after another rank failed (it would wait for
    that rank), is killed by its PID: its code reads -9. free_port() lets the port go before rank 0's store binds
    it: a job that met a stranger on it ("address already in use", before any step) runs again on another port.
    That error cannot come from a step or a teardown, so no abort hides behind the retry.
    """
    for attempt in range(tries):
        ctx = mp.start_processes(rank_main, args=(nprocs, free_port(), *args), nprocs=nprocs, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while alive := [p for p in ctx.processes if p.exitcode is None]:
            if any(p.exitcode for p in ctx.processes):
                deadline = min(deadline, time.monotonic() + grace_s)
            if time.monotonic() >= deadline:
                break
            wait([p.sentinel for p in alive], timeout=deadline - time.monotonic())
        for p in ctx.processes:
            if p.exitcode is None:
                p.kill()
            p.join()
        errors = []
        for path in ctx.error_files:  # written only by a rank that raised
            if os.path.exists(path):
                with open(path, "rb") as f:
                    errors.append(pickle.load(f))
                os.unlink(path)
            else:
                errors.append("")
        if not (attempt < tries - 1 and any("address already in use" in e.lower() for e in errors)):
            return [p.exitcode for p in ctx.processes], errors
    raise AssertionError("unreachable")


def outcome(codes: list[int], errors: list[str]) -> str:
    """"ok", or how the job failed: a raised error's last line (its peers were ended after it), else the first rank
    that ended by a signal or a non-zero exit."""
    for error in errors:
        if error:
            return f"a rank raised: {error.strip().splitlines()[-1]}"
    for rank, code in enumerate(codes):
        if code:
            return f"rank {rank} exited {code}" + (f" (signal {signal.Signals(-code).name})" if code < 0 else "")
    return "ok"
