"""Lesson 07's memory calculator (ddp_lib.kit.memory) and the rule that running a lesson leaves assets/ alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddp_lib.kit.memory import (
    GB,
    H100_BYTES,
    WRITE_UP,
    XXL,
    ZERO_PAPER,
    FFNModel,
    activation_bytes,
    fsdp_devices_needed,
    fsdp_per_device,
    gpus_needed,
    model_state_bytes,
    plot_zero_memory,
    zero_per_rank,
)

ROOT = Path(__file__).resolve().parent.parent


def test_xxl_model_size_and_write_up_split():
    assert XXL.params == 219_848_638_464  # 126 blocks x (16384 x 53248 + 53248 x 16384)
    states = model_state_bytes(XXL.params, WRITE_UP)
    assert states == {"weights": 879_394_553_856, "gradients": 879_394_553_856, "optimizer": 1_758_789_107_712}
    assert gpus_needed(states["weights"] + states["gradients"]) == 22  # 1,758.8 GB on 80 GB H100s
    paper = model_state_bytes(XXL.params, ZERO_PAPER)
    assert gpus_needed(paper["weights"] + paper["gradients"]) == 11
    assert sum(paper.values()) == sum(states.values())  # both accountings are 16 bytes per parameter


def test_activation_bytes_counts_input_and_hidden_per_token_in_bf16():
    assert activation_bytes(XXL, 4, 2048) == 143_747_186_688
    assert activation_bytes(FFNModel(d_model=3, d_ff=5, blocks=2), batch=7, seq=11) == 2 * 7 * 11 * 8 * 2


def test_gpus_needed_rounds_up():
    assert gpus_needed(H100_BYTES) == 1
    assert gpus_needed(H100_BYTES + 1) == 2


@pytest.mark.parametrize("split", [WRITE_UP, ZERO_PAPER])
def test_zero_stages_shard_more_as_the_stage_grows(split):
    n = XXL.params
    for g in (1, 2, 64, 1024):
        per_stage = [zero_per_rank(n, g, s, split) for s in range(4)]
        assert per_stage == sorted(per_stage, reverse=True)
        assert zero_per_rank(n, g, 0, split) == sum(split) * n  # DDP: everything on every rank
    assert len({zero_per_rank(n, 1, s, split) for s in range(4)}) == 1  # one rank: nothing to shard
    assert zero_per_rank(n, 44, 3, split) <= H100_BYTES < zero_per_rank(n, 43, 3, split)


def test_zero1_floor_differs_between_the_accountings():
    n = XXL.params
    huge = 10**12
    assert zero_per_rank(n, huge, 1, ZERO_PAPER) == pytest.approx(4 * n, rel=1e-9)  # 16-bit weights + grads
    assert zero_per_rank(n, huge, 1, WRITE_UP) == pytest.approx(8 * n, rel=1e-9)  # fp32 weights + grads


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_fsdp_devices_needed_is_the_smallest_count_that_fits(batch):
    act = activation_bytes(XXL, batch, 2048)
    g = fsdp_devices_needed(XXL.params, act)
    assert g is not None
    assert fsdp_per_device(XXL.params, g, act) <= H100_BYTES < fsdp_per_device(XXL.params, g - 1, act)


def test_fsdp_devices_needed_worked_by_hand():
    """16 B x 219,848,638,464 = 3,517.6 GB of states; 126 x 2048 x 69,632 x 2 B = 35.9 GB of activations for one
    2048-token sequence; (3517.6 + 18.0) / (80 - 18.0) = 57.0 -> 57 GPUs (4 sequences: 442; 8: never)."""
    assert activation_bytes(XXL, 1, 2048) == 35_936_796_672
    for batch, want in ((1, 57), (4, 442), (8, None)):
        assert fsdp_devices_needed(XXL.params, activation_bytes(XXL, batch, 2048)) == want


def test_fsdp_never_fits_when_the_unsharded_activations_alone_do_not():
    act = activation_bytes(XXL, 8, 2048)  # half of it is 143.7 GB
    assert act / 2 > 80 * GB
    assert fsdp_devices_needed(XXL.params, act) is None


def test_fsdp_per_device_shards_half_of_the_activations():
    act = 10 * GB
    one = fsdp_per_device(XXL.params, 1, act)
    many = fsdp_per_device(XXL.params, 10**12, act)
    assert one == pytest.approx(16 * XXL.params + act)  # a single device holds everything
    assert many == pytest.approx(act / 2, rel=1e-6)  # the replicated half stays


def test_plot_zero_memory_writes_only_where_asked(tmp_path):
    asset = ROOT / "assets" / "zero_memory.png"
    before = asset.stat().st_mtime_ns if asset.exists() else None
    out = plot_zero_memory(tmp_path / "sub" / "zero.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (asset.stat().st_mtime_ns if asset.exists() else None) == before


def test_no_lesson_code_cell_writes_into_assets():
    # learners run the lessons: figures go to runs/ (git-ignored), README assets are made by commands
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                assert "assets" not in "".join(cell["source"]), f"{path.name} writes into assets/"
