"""Lesson 09's flight recorder on gloo ranks: a lone all-reduce is found by torch's fr_trace, naming the missing rank."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_lib.apps.flight import dump_flight_record, read_flight_records
from ddp_lib.launch import spawn


def _lone_all_reduce(folder: str) -> str | None:
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=1))
    dist.all_reduce(torch.ones(2))
    if dist.get_rank() == 0:  # rank 1 never joins: a timeout, recorded by gloo's flight recorder
        try:
            dist.all_reduce(torch.ones(4), group=side)
        except RuntimeError:
            pass
    dump_flight_record(folder)
    dist.barrier()
    return read_flight_records(folder) if dist.get_rank() == 0 else None


def test_fr_trace_names_the_rank_that_never_joined(tmp_path):
    report = spawn(_lone_all_reduce, 2, backend="gloo", timeout_s=120, args=(str(tmp_path),))[0]
    assert "Not all ranks joining collective, sequence number: 1" in report, report
    assert "collective: gloo:all_reduce" in report and "missing ranks: {1}" in report, report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_0", "rank_1"]
