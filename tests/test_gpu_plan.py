"""Sizes follow the GPU's memory: the lessons' real sizes planned on the meta device against each GPU profile."""

from __future__ import annotations

import pytest
import torch

from ddp_lib.course.gpu_needs import DRY_PEAK_GIB, HOST_NEED_GIB, NEED_GIB, on_meta, sizes
from ddp_lib.course.gpu_plan import PLANS, PeakBytes, peak_gib
from ddp_lib.devices import fits_gpu, small_scale

# total_memory per GPU in GiB, about what get_device_properties reports (a bit below the card's size in GB):
# H100 80 GB, T4 16 GB, L4 24 GB, A100 40 GB
PROFILES = {"1xH100": 79.1, "8xH100": 79.1, "2xT4": 14.6, "1xL4": 22.0, "2xA100": 39.6}
# what each lesson's parameters cell picks per profile: True = the real sizes, False = the small ones
EXPECTED = {"02": {"1xH100": True, "8xH100": True, "2xT4": False, "1xL4": False, "2xA100": True},
            "04": {"1xH100": True, "8xH100": True, "2xT4": False, "1xL4": True, "2xA100": True},
            "05": {"1xH100": True, "8xH100": True, "2xT4": False, "1xL4": False, "2xA100": True},
            "06": {"1xH100": True, "8xH100": True, "2xT4": True, "1xL4": True, "2xA100": True},
            "07": {"1xH100": True, "8xH100": True, "2xT4": False, "1xL4": False, "2xA100": True},
            "08": {"1xH100": True, "8xH100": True, "2xT4": False, "1xL4": True, "2xA100": True}}


def test_the_tracker_counts_live_storages_and_their_peak():
    def step(tracker: PeakBytes) -> None:
        a = torch.empty(2**20)  # 4 MiB
        b = torch.empty(2**20)
        del a, b
        c = torch.empty(2**19)  # 2 MiB, after both were freed
        tracker.add(c)  # counted once
        c.add_(1)  # in place: no new storage
    assert peak_gib(step) * 2**10 == pytest.approx(8.0)


def test_views_share_a_storage_and_count_once():
    def step(_: PeakBytes) -> None:
        x = torch.empty(1024, 1024)
        x.view(-1)[:10], x.t(), x.reshape(1024, 1024)
    assert peak_gib(step) * 2**10 == pytest.approx(4.0)


@pytest.mark.slow
@pytest.mark.parametrize("lesson", sorted(PLANS))
def test_the_committed_needs_cover_the_meta_device_plan(lesson):
    planned = max(peak_gib(PLANS[lesson]), DRY_PEAK_GIB.get(lesson, 0.0))  # or the dry peak where it is larger
    assert planned <= NEED_GIB[lesson] <= 1.05 * planned  # committed from this plan, rounded up


@pytest.mark.parametrize("lesson", sorted(EXPECTED))
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_each_profile_gets_sizes_that_fit(lesson, profile, monkeypatch):
    total = PROFILES[profile]
    assert fits_gpu(NEED_GIB[lesson], total) is EXPECTED[lesson][profile]
    # small_scale decides the same on a rank of that box (its group communicating on cuda:0)
    monkeypatch.delenv("DDP_SMALL", raising=False)
    monkeypatch.setattr("ddp_lib.devices.comm_device", lambda group=None: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": int(total * 2**30)})())
    assert small_scale(need_gib=NEED_GIB[lesson]) is not EXPECTED[lesson][profile]
    monkeypatch.setenv("DDP_SMALL", "1")
    assert small_scale(need_gib=NEED_GIB[lesson]) is True


def test_cpu_ranks_are_always_small(monkeypatch):
    monkeypatch.delenv("DDP_SMALL", raising=False)
    monkeypatch.setattr("ddp_lib.devices.comm_device", lambda group=None: torch.device("cpu"))
    assert small_scale(need_gib=0.0) is True


def test_every_lesson_that_allocates_by_size_is_planned_and_asks_with_its_plan():
    import re
    from pathlib import Path

    import nbformat

    def code(lesson: str) -> str:
        path = next((Path(__file__).resolve().parent.parent / "notebooks").glob(f"{lesson}_*.ipynb"))
        return "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")

    for lesson in ("02", "04", "05", "06", "07", "08"):
        assert lesson in PLANS and re.search(rf'small_scale\(need_gib=NEED_GIB\["{lesson}"\]', code(lesson)), lesson
    for lesson in ("02", "05", "06", "07", "08"):  # their real sizes hold GiB on the host too
        assert f'host_gib=HOST_NEED_GIB["{lesson}"]' in code(lesson), lesson


def test_lesson02_plans_the_cpu_copy_it_builds_lm_xl_from():
    from ddp_lib.bench.workloads import get_workload

    copy_gib = sizes(on_meta(get_workload("lm-xl").build))[0] * 4 / 2**30
    assert copy_gib < HOST_NEED_GIB["02"] <= copy_gib + 2.0


@pytest.mark.parametrize("lesson", ["05", "07"])
def test_host_need_is_below_one_fp32_copy_of_lm_xl_where_it_is_built_on_the_gpu(lesson):
    """05's race keeps its reference on the device (tests/test_gpusim_dry.py) and 07's memory cell builds each model
    on the GPU (tests/test_lesson_host_memory.py): a rank's host memory is the process's own, as a dry run at lm-xl
    measures it, far below one fp32 copy of lm-xl."""
    from ddp_lib.bench.workloads import get_workload

    params = sizes(on_meta(get_workload("lm-xl").build))[0]
    assert 0 < HOST_NEED_GIB[lesson] < 0.5 * params * 4 / 2**30


@pytest.mark.parametrize("free_gib, small", [(64.0, False), (HOST_NEED_GIB["05"], True)])
def test_a_host_too_small_picks_small_sizes_and_says_why(free_gib, small, monkeypatch, capsys):
    monkeypatch.delenv("DDP_SMALL", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("ddp_lib.devices.comm_device", lambda group=None: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": int(79.1 * 2**30)})())
    monkeypatch.setattr("ddp_lib.devices.host_available_gib", lambda: free_gib)
    assert small_scale(need_gib=NEED_GIB["05"], host_gib=HOST_NEED_GIB["05"]) is small
    out = capsys.readouterr().out
    assert out.count("small sizes:") == int(small) and ("host memory per rank x 2 ranks" in out) is small


def test_a_gpu_too_small_says_why_in_one_line(monkeypatch, capsys):
    monkeypatch.delenv("DDP_SMALL", raising=False)
    monkeypatch.setattr("ddp_lib.devices.comm_device", lambda group=None: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": int(14.6 * 2**30)})())
    assert small_scale(need_gib=NEED_GIB["05"]) is True
    assert capsys.readouterr().out.splitlines() == [
        "small sizes: this lesson's real sizes need 28 GiB of tensors per GPU (planned), this GPU has 14.6 GiB"]


def test_lesson07s_plan_steps_adamw_as_cuda_does():
    """On CUDA torch's AdamW defaults to foreach, whose step allocates a parameter-sized temporary: the plan too."""
    import inspect

    from ddp_lib.course import gpu_plan

    assert "foreach=True" in inspect.getsource(gpu_plan._lm_adamw_bucketed)
