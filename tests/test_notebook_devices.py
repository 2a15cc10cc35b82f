"""`%dist_init`'s device choice, with the GPU count patched: auto NCCL on GPUs 0..N-1, --cpu, -g, bad input."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from IPython.core.error import UsageError

from ddp_lib.notebook import magics
from ddp_lib.notebook._devices import gpu_without_cuda_note, plan_devices, worker_visible_devices


def test_cpu_machine_runs_gloo():
    plan = plan_devices(2, None, False, visible=0)
    assert (plan.gpu_ids, plan.backend, plan.note) == (None, "gloo", None)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_enough_gpus_give_rank_i_gpu_i_and_nccl(n):
    plan = plan_devices(n, None, False, visible=8)
    assert (plan.gpu_ids, plan.backend) == (list(range(n)), "nccl")


def test_fewer_gpus_than_ranks_fall_back_to_gloo_and_say_so():
    plan = plan_devices(4, None, False, visible=2)
    assert (plan.gpu_ids, plan.backend) == (None, "gloo")
    assert "only 2 GPU(s) visible for 4 ranks" in plan.note


def test_cpu_flag_forces_gloo_on_a_gpu_box():
    assert plan_devices(2, None, True, visible=8) == plan_devices(2, None, False, visible=0)


def test_gpu_ids_override_the_automatic_choice():
    plan = plan_devices(2, "3,1", False, visible=4)
    assert (plan.gpu_ids, plan.backend) == ([3, 1], "nccl")
    assert plan_devices(2, "'0,1,2'", False, visible=4).gpu_ids == [0, 1]  # extra ids unused, quotes allowed


@pytest.mark.parametrize("spec, n, match", [
    ("0,1", 4, "4 ranks need 4 distinct GPU IDs"),  # more ranks than GPUs: an error, not two ranks on one GPU
    ("0,0", 2, "2 ranks need 2 distinct GPU IDs"),
    ("0,5", 2, r"Invalid GPU IDs: \[5\]"),
    ("0;1", 2, "comma-separated integers"),
])
def test_bad_gpu_ids_are_errors(spec, n, match):
    with pytest.raises(UsageError, match=match):
        plan_devices(n, spec, False, visible=2)


def test_cpu_and_gpu_ids_together_are_an_error():
    with pytest.raises(UsageError, match="contradict"):
        plan_devices(2, "0,1", True, visible=2)


def test_gpu_ids_without_cuda_are_ignored_with_a_warning_as_in_nbdistributed():
    plan = plan_devices(2, "0,1", False, visible=0)
    assert (plan.gpu_ids, plan.backend) == (None, "gloo") and "CUDA not available" in plan.note


def test_a_torch_without_nccl_stays_on_gloo():
    assert plan_devices(2, None, False, visible=2, nccl=False).backend == "gloo"
    with pytest.raises(UsageError, match="no NCCL"):
        plan_devices(2, "0,1", False, visible=2, nccl=False)


def test_rank_gpus_index_what_the_kernel_sees():
    assert worker_visible_devices([0, 1], None) == "0,1"
    assert worker_visible_devices([0, 1], "") == "0,1"
    assert worker_visible_devices([1, 0], "4,6") == "6,4"  # kernel started with CUDA_VISIBLE_DEVICES=4,6
    # CPU ranks (gloo on a GPU box) see no GPU at all (tests/test_gpusim_fallback.py runs it on a simulated 1xH100)
    assert worker_visible_devices(None, "4,6") == worker_visible_devices(None, None) == ""
    assert worker_visible_devices([0], "GPU-aa, GPU-bb") == "GPU-aa"


class FakeCluster:
    """Stands in for the worker processes: records what %dist_init asked for."""

    def __init__(self, n, gpu_ids, master_addr, master_port, backend=None):
        self.n, self.gpu_ids, self.backend, self.broken = n, gpu_ids, backend, None
        self.status = {r: {"backend": backend, "device": f"cuda:{r}" if gpu_ids else "cpu"} for r in range(n)}

    def alive(self, r):
        return True

    def shutdown(self, grace_s):
        pass


@pytest.fixture
def dist_init(monkeypatch):
    """`%dist_init <line>` with `visible` GPUs patched in; returns the cluster it started."""
    monkeypatch.setattr(magics, "Cluster", FakeCluster)
    monkeypatch.setattr(magics, "nccl_available", lambda: True)

    def run(line: str, visible: int) -> FakeCluster:
        monkeypatch.setattr(magics, "visible_gpus", lambda: visible)
        m = magics.DistributedMagics(shell=None)
        m.dist_init(line)
        return m.cluster
    return run


def test_the_plain_lesson_line_is_gloo_on_a_laptop_and_nccl_on_a_gpu_box(dist_init, capsys):
    laptop = dist_init("-n 2", visible=0)
    assert (laptop.n, laptop.gpu_ids, laptop.backend) == (2, None, "gloo")
    box = dist_init("-n 2", visible=8)
    assert (box.n, box.gpu_ids, box.backend) == (2, [0, 1], "nccl")
    assert "(nccl): rank 0 -> cuda:0, rank 1 -> cuda:1" in capsys.readouterr().out
    assert dist_init("-n 8", visible=8).gpu_ids == list(range(8))


def test_magic_flags_reach_the_cluster(dist_init):
    assert dist_init("-n 2 --cpu", visible=8).backend == "gloo"
    assert dist_init("-n 2 -g 2,3", visible=8).gpu_ids == [2, 3]
    with pytest.raises(UsageError, match="distinct GPU IDs"):
        dist_init("-n 4 -g 0,1", visible=8)


def test_a_single_gpu_box_says_out_loud_that_its_ranks_run_on_the_cpu(dist_init, capsys):
    one = dist_init("-n 2", visible=1)
    assert (one.gpu_ids, one.backend) == (None, "gloo")
    err = capsys.readouterr().err
    assert "CPU ranks, not GPUs" in err and "only 1 GPU(s) visible for 2 ranks" in err and "-n 1" in err
    assert err.count("⚠") == 1, err  # one warning sign for one warning
    dist_init("-n 2 --cpu", visible=1)  # asked for: no warning
    assert "CPU ranks" not in capsys.readouterr().err


def test_gpus_that_torch_cannot_use_are_named_with_the_fix(monkeypatch):
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_without_cuda_note(has_smi=False, dev_nodes=[]) is None  # a laptop: nothing to say
    monkeypatch.setattr(torch.version, "cuda", None)
    cpu_build = gpu_without_cuda_note(has_smi=True, dev_nodes=[])
    assert "nvidia-smi" in cpu_build and "CPU-only build" in cpu_build and "make setup" in cpu_build
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    old_driver = gpu_without_cuda_note(has_smi=False, dev_nodes=["/dev/nvidia0"])
    assert "/dev/nvidia0" in old_driver and "CUDA 13.0" in old_driver and "driver" in old_driver
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden on purpose: no note
    assert gpu_without_cuda_note(has_smi=True, dev_nodes=["/dev/nvidia0"]) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # CUDA works: no note
    assert gpu_without_cuda_note(has_smi=True, dev_nodes=["/dev/nvidia0"]) is None


def test_a_kernel_on_a_machine_without_gpus_starts_its_ranks_without_importing_torch():
    """%dist_init asks torch for GPUs only where a GPU could be (a device node, nvidia-smi, torch already loaded):
    elsewhere the kernel would spend seconds importing torch before any rank starts, to learn 0."""
    code = ("import sys; from ddp_lib.notebook._devices import _no_gpu_in_sight, visible_gpus; "
            "blind = _no_gpu_in_sight(); print(blind, visible_gpus(), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "DDP_GPU_SIM"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    blind, visible, imported = out.split()
    if blind == "True":  # no GPU in sight: 0 GPUs, and torch never imported
        assert (visible, imported) == ("0", "False"), out
    else:  # a GPU box (or a device node): torch answers, as before
        assert imported == "True", out
