"""ddp_lib.course.gpu_needs: sizes from models built on the meta device; memory that follows the training setup."""

from __future__ import annotations

from ddp_lib.course.gpu_needs import Workload, markdown, needs, on_meta, sizes, workloads
from ddp_lib.kit.models import TransformerLM, count_params


def test_meta_sizes_match_a_real_model():
    params, linear = sizes(on_meta(lambda: TransformerLM("tiny")))
    real = TransformerLM("tiny")
    assert params == count_params(real)
    assert linear > params - real.tok.weight.numel() - real.pos.weight.numel()  # the tied head is a matmul too


def test_zero1_state_shrinks_with_ranks_and_equals_adamw_on_one():
    lm = lambda: TransformerLM("tiny")  # noqa: E731
    adamw = Workload("x", "adamw", lm, 2, 16, optimizer_bytes=8, global_batch=False)
    zero = Workload("x", "zero1", lm, 2, 16, optimizer_bytes=8, zero1=True, global_batch=False)
    assert needs(zero, 1)["state_GiB"] == needs(adamw, 1)["state_GiB"]
    assert needs(adamw, 2)["state_GiB"] > needs(zero, 2)["state_GiB"] > needs(zero, 8)["state_GiB"]


def test_a_global_batch_splits_over_ranks_and_time_follows_flops():
    mlp = [w for w in workloads() if w.lesson == "02"][0]
    two, eight = needs(mlp, 2), needs(mlp, 8)
    assert two["tokens"] == 4 * eight["tokens"] and two["TFLOP"] > eight["TFLOP"]
    assert two["ms_fp32"] > two["ms_tf32"] > two["ms_bf16"] > 0


def test_the_readme_table_covers_the_gpu_lessons():
    table = markdown(2)
    assert {"| 02 |", "| 05 |", "| 06 |", "| 07 |"} <= {line[:6] for line in table.splitlines()}
    assert "SmolLM2-360M" in table and "1,492 M" in table  # the xl LM the lessons train
