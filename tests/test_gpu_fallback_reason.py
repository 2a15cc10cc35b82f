"""A box with fewer GPUs than ranks (a single-GPU cloud box): `%dist_init` says in one line why the ranks run on the CPU."""

from __future__ import annotations

import pytest

from ddp_lib.notebook._devices import cpu_fallback_reason, plan_devices


def test_single_gpu_box_explains_the_cpu_fallback_in_one_line():
    plan = plan_devices(2, None, False, visible=1)
    assert (plan.gpu_ids, plan.backend) == (None, "gloo")
    note = plan.note
    assert note and "\n" not in note
    for words in ("only 1 GPU(s) visible for 2 ranks", "NCCL needs one GPU per rank", "CPU with gloo",
                  "%dist_init -n 1 would use it, for one rank alone: the lessons need 2 ranks"):
        assert words in note, (words, note)


@pytest.mark.parametrize("n,visible", [(4, 2), (8, 7)])
def test_too_few_gpus_name_both_counts(n, visible):
    note = plan_devices(n, None, False, visible=visible).note
    assert f"only {visible} GPU(s) visible for {n} ranks" in note and f"-n {visible} would use them" in note


def test_no_nccl_names_the_build_not_the_gpu_count():
    note = plan_devices(2, None, False, visible=2, nccl=False).note
    assert "no NCCL" in note and "CPU with gloo" in note and "\n" not in note


def test_nothing_to_explain_without_a_gpu_or_with_enough():
    assert cpu_fallback_reason(2, 0) is None and plan_devices(2, None, False, visible=0).note is None
    assert plan_devices(2, None, False, visible=2).note is None
