"""The α–β fit lessons 04 and 05 use: the one saved (lesson 01's), else one measured here in seconds, saying so.

No lesson may depend on a file an earlier lesson wrote without a fallback: on a fresh GPU box lesson 01 has not
run, and there is no committed reference fit for NCCL. `fit_or_measure` is called on every rank; if any rank
finds no saved fit for (backend, world size), all of them time a short all-reduce sweep and fit it in place.

`rows_file` names the file lesson 01 keeps its rows in between its 2-rank and 4-rank sessions. It is keyed by the
notebook kernel (`DDP_NB_PARENT_PID`, which `%dist_init` gives every rank), not by the rank's parent process: NCCL
ranks are fresh interpreters started by the kernel, gloo ranks are forked from the kernel's template (the fork
server), so their parents differ although they belong to the same notebook.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from ddp_lib import comm
from ddp_lib.bench.alphabeta import (REFERENCE_FIT, ROW_KEYS, RUNS_FIT, AlphaBeta, as_pipelined, fit_by_group,
                                     fit_records, load_fit, save_fits, save_pipelined_fit)
from ddp_lib.devices import comm_device

ENV_KERNEL = "DDP_NB_PARENT_PID"  # ddp_lib.notebook._protocol.ENV_PARENT: the kernel that started the ranks
# a quick sweep that straddles the crossover: 4 KiB..4 MiB on CPU (gloo), 64 KiB..256 MiB on GPUs
QUICK_CPU = [4096 * 4**i for i in range(6)]
QUICK_GPU = [65536 * 4**i for i in range(7)]


def session_key() -> str:
    """The notebook session this rank belongs to: the kernel's PID, whatever started the rank (else its parent's)."""
    return os.environ.get(ENV_KERNEL) or str(os.getppid())


def rows_file(world_size: int | str = "{}") -> str:
    """Where lesson 01 keeps one session's all-reduce rows: one file per kernel and world size (`"{}"`: a pattern)."""
    return os.path.join(tempfile.gettempdir(), f"ddp_lesson01_rows_{session_key()}_{world_size}.json")


def fit_or_measure(paths: Iterable[str | Path] = (RUNS_FIT, REFERENCE_FIT), save_to: str | Path | None = RUNS_FIT,
                   sizes: list[int] | None = None, iters: int = 5, warmup: int = 1,
                   pipelined: bool = False) -> tuple[AlphaBeta, dict]:
    """Call on every rank: (model, record) of the saved fit for this group's backend and size, else of one measured
    now over `sizes` (merged into `save_to`); the record's `measured_here_s` says how long that took (None: loaded).

    `pipelined=True` (predictions of calls issued back to back): the pipelined α where saved (`load_fit`), and when
    measuring here, the pipelined sweep too; `alpha_method` in the record says which α the model holds."""
    from ddp_lib.bench.allreduce import allreduce_pipelined_rank_bench, allreduce_rank_bench, machine_label

    backend, ws, device = dist.get_backend(), dist.get_world_size(), comm_device()
    try:
        model, record = load_fit(backend, ws, paths, pipelined=pipelined)
        found = 1
    except FileNotFoundError:
        found = 0
    flag = torch.tensor([found], device=device)
    comm.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank measures, or none: the sweep is collective
    if flag.item():
        return model, {**record, "measured_here_s": None}
    t0 = time.perf_counter()
    sizes = sizes or (QUICK_GPU if device.type == "cuda" else QUICK_CPU)
    rows = allreduce_rank_bench(sizes, iters=iters, warmup=warmup, budget_s=0.5)
    (record,) = fit_records(rows)
    rows_pipe = allreduce_pipelined_rank_bench(sizes, iters=iters, warmup=warmup, budget_s=0.5) if pipelined else []
    machine = machine_label(device)
    where = "not saved"
    if save_to is not None:
        if dist.get_rank() == 0:
            save_fits(rows, save_to, machine=machine)
            if rows_pipe:
                save_pipelined_fit(rows_pipe, save_to)
        comm.barrier()  # a reader after this call finds the file whole
        where = str(save_to)
    model = AlphaBeta(record["alpha_s"], record["beta_s_per_byte"], record.get("alpha_resolved", True))
    method = "per call"
    if rows_pipe:
        model, method = fit_by_group(rows_pipe)[(backend, ws)], "pipelined"
        record = as_pipelined(record, dict(**model.as_dict(),
                                           rows=[{k: r[k] for k in ROW_KEYS if k in r} for r in rows_pipe]))
    return model, {**record, "machine": machine, "path": where, "measured_here_s": time.perf_counter() - t0,
                   "alpha_method": method}


def describe(record: dict) -> str:
    """Where a fit came from, in one line: the file, or measured here because none was saved (and how long), and
    which α it holds (`alpha_method`: pipelined, per call, or per call because no pipelined fit was saved)."""
    method = record.get("alpha_method")
    alpha = f"; alpha {method}" if method else ""
    if record.get("measured_here_s") is None:
        return f"fit from {record['path']} ({record['machine']}){alpha}"
    return (f"no saved α–β fit for {record['backend']} x{record['world_size']} (lesson 01 did not run on this box): "
            f"measured here in {record['measured_here_s']:.1f} s over {len(record['rows'])} sizes "
            f"({record['machine']}), saved to {record['path']}{alpha}")
