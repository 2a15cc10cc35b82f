"""Lesson 09's flight recorder on gloo ranks: each rank dumps its record, torch's `fr_trace` lines them up.

In torch 2.13 gloo's process groups record their collectives in a flight recorder too (`ProcessGroupGloo.hpp`:
`trace_id_`, "unique id used to tell the trace buffer that this work has completed"), a ring buffer of 2000 entries
unless `TORCH_FR_BUFFER_SIZE` (or the older `TORCH_NCCL_TRACE_BUFFER_SIZE`) says otherwise (`FlightRecorder.hpp`).
NCCL writes the dump itself on a watchdog timeout; on gloo we take it with
`torch._C._distributed_c10d._dump_fr_trace()`. One gap: the table of groups and their ranks (`pg_config`) is
filled when NCCL builds a communicator (`fr_trace`'s `builder.build_groups_memberships` docstring), so a gloo dump
leaves it empty and `fr_trace` stops with a KeyError; `dump_flight_record` fills it from c10d's registry of groups.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_lib.devices import needs_process_group

PREFIX = "rank_"


@needs_process_group
def dump_flight_record(folder: str | os.PathLike) -> Path:
    """Write this rank's flight record to folder/rank_<global rank>, with the group table gloo leaves empty;
    issues no collective (a hung group must still be dumpable)."""
    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    world = dist.distributed_c10d._world
    trace["pg_config"] = {name: {"name": name, "desc": "undefined", "ranks": str(dist.get_process_group_ranks(pg))}
                          for pg, name in world.pg_names.items()}
    # records of a group c10d does not list (a backend's private one, e.g. the GPU simulation's) cannot be matched
    trace["entries"] = [e for e in trace["entries"] if e["process_group"][0] in trace["pg_config"]]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{PREFIX}{dist.get_rank()}"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(trace))
    os.replace(tmp, path)  # fr_trace reads every file in the folder: never a half-written one
    return path


def read_flight_records(folder: str | os.PathLike) -> str:
    """Run torch's analyser (`python -m torch.distributed.flight_recorder.fr_trace <folder>`, also installed as
    `torchfrtrace`) in this process and return what it logged."""
    import contextlib
    import gc

    gc_was_on, out = gc.isenabled(), io.StringIO()
    with contextlib.redirect_stderr(out):  # its logger's own handler binds stderr at import: keep it off the cell
        from torch.distributed.flight_recorder import fr_trace

    log = logging.getLogger("Flight Recorder")  # fr_trace reports through this logger, not print
    saved, log.handlers = log.handlers, [logging.StreamHandler(out)]
    try:
        fr_trace.main([str(folder), "--prefix", PREFIX])
    finally:
        log.handlers = saved
        if gc_was_on:
            gc.enable()  # fr_trace's loader switches the garbage collector off for good
    return out.getvalue()
