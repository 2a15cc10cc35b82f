"""GPU timings a learner reads off a lesson are taken and labelled as a GPU box needs (issue 59's engineer's list).

Lesson 09's step race timed NCCL steps with the host clock and no synchronize (the clock stops while kernels are
still queued) and labelled itself "loopback (gloo)" on NCCL ranks; 04 and 05 called an NCCL race "loopback".
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import torch

from ddp_lib.bench.allreduce import link_label

ROOT = Path(__file__).resolve().parent.parent


def _code(lesson: str, cell_id: str | None = None) -> str:
    nb = nbformat.read(next((ROOT / "notebooks").glob(f"{lesson}_*.ipynb")), as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code" and cell_id in (None, c.get("id")))


def test_the_link_is_named_from_the_ranks_device_and_backend(monkeypatch):
    assert link_label(torch.device("cpu"), "gloo") == "loopback (gloo)"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    label = link_label(torch.device("cuda", 0), "nccl")
    assert label == "nccl, GPU to GPU (Tesla T4)" and "loopback" not in label


def test_no_lesson_names_its_real_link_loopback_by_hand():
    hand_made = ['"real loopback"', '"loopback" if SMALL', '"loopback (gloo)"', 'f"{where:>8}: ']
    for lesson in ("04", "05", "09"):
        code = _code(lesson)
        assert not [h for h in hand_made if h in code], lesson
        assert "link_label(device" in code, lesson


def test_lesson09s_step_race_drains_the_device_before_each_clock_read():
    cell = _code("09", "c19c")
    body = cell[cell.index("def step_ms"):cell.index("q = torch.tensor")]
    lines = [ln.strip() for ln in body.splitlines()]
    reads = [i for i, ln in enumerate(lines) if "time.perf_counter()" in ln]
    assert len(reads) == 2
    for i in reads:  # the statement before each read of the clock waits for the GPU
        assert lines[i - 1].startswith("sync(device)"), lines[i - 1]


def test_lesson08_compares_the_shards_with_a_whole_model_drawn_by_the_same_generator():
    """On GPUs the shards' reset_parameters() draws from the CUDA generator; a whole model drawn on the CPU and moved
    to the GPU came from the CPU's, so the comparison said False whatever the shards held."""
    cell = _code("08", "2488dd9b")
    whole = cell[cell.index("torch.manual_seed(0)\nwith"):cell.index("w, W =")]
    assert "with torch.device(device):" in whole and ".to(device)" not in whole
