"""The CPU code paths still work on a box with 2 or 8 GPUs that the ranks do not use (simulated on this machine).

Every process (the test's subprocess and each rank it spawns) imports a `sitecustomize` that makes torch
report `n` CUDA GPUs and an NCCL backend. CPU code must then still ask for gloo: before the fix, `spawn`
picked nccl and the first collective on a CPU tensor (or `torch.cuda.set_device`) failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sim_box import run_in_session

ROOT = Path(__file__).resolve().parent.parent
SITECUSTOMIZE = textwrap.dedent("""
    # written by tests/test_gpu_simulated.py: this process believes it sees DDP_FAKE_GPUS CUDA GPUs and NCCL
    import os
    import torch
    import torch.distributed as dist

    _n = int(os.environ["DDP_FAKE_GPUS"])
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: _n
    dist.is_nccl_available = lambda: True
    # a CUDA build has NVTX (ddp_lib.kit.profiling.phase marks ranges with it when CUDA is available); this CPU
    # build raises on them, which no real GPU box would: no-ops, as NVTX is without a profiler attached
    torch.cuda.nvtx.range_push = lambda msg: 0
    torch.cuda.nvtx.range_pop = lambda: 0

    # torch's own accelerator queries answer as on a real GPU box, on the CPU build and on the CUDA build alike:
    # CUDA is the accelerator, and its current stream is not capturing a graph (torch's Adam asks, every step).
    # Anything that needs a real GPU (an allocation, a kernel, a real stream op) still fails loudly: on the CUDA
    # build with "Found no NVIDIA driver", as it would on a box whose ranks were wrongly sent to the GPU.
    class _IdleStream:
        device = torch.device("cuda", 0)

        def is_capturing(self) -> bool:
            return False

    torch.accelerator.is_available = lambda: True
    torch.accelerator.device_count = lambda: _n
    torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cuda")
    torch.accelerator.current_stream = lambda device=None: _IdleStream()
    torch.cuda.is_current_stream_capturing = lambda: False
""")
# a fast engine case and a ZeRO-1 case: each spawns 2 ranks through ddp_lib.launch.spawn with no backend given
CPU_TESTS = ["tests/test_ddp.py", "tests/test_optim.py", "-k",
             "(unused_parameters and bucketed) or wrapping_broadcasts_rank0_state[flat] or resume_with_a_scheduler"]


def _run(cmd: list[str], fake_gpus: int, tmp_path: Path, timeout_s: float = 600) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = dict(os.environ, DDP_FAKE_GPUS=str(fake_gpus), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return run_in_session(cmd, env, timeout_s)


# every check runs on a box with as many GPUs as ranks (2) and on an 8-GPU box; the slow ones once, on one of them
BOTH = pytest.mark.parametrize("fake_gpus", [2, 8], ids=["2gpus", "8gpus"])


@BOTH
def test_the_simulation_takes_effect(fake_gpus, tmp_path):
    """Without this, the tests below could pass because nothing was simulated."""
    probe = ("import torch; from ddp_lib.devices import pick_backend;"
             "print(torch.cuda.is_available(), torch.cuda.device_count(), pick_backend(2),"
             " torch.accelerator.current_accelerator(check_available=True).type,"
             " torch.accelerator.current_stream().is_capturing())")
    r = _run([sys.executable, "-c", probe], fake_gpus, tmp_path, timeout_s=120)
    assert r.returncode == 0, r.stdout
    assert r.stdout.strip().splitlines()[-1] == f"True {fake_gpus} nccl cuda False"


@pytest.mark.parametrize("fake_gpus", [2], ids=["2gpus"])
def test_demo_runs_on_gloo(fake_gpus, tmp_path):
    r = _run([sys.executable, "-m", "ddp_lib.course.demo"], fake_gpus, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "gloo" in r.stdout and "every engine matches single-process training" in r.stdout


@pytest.mark.parametrize("fake_gpus", [8], ids=["8gpus"])
def test_cpu_engine_and_zero1_tests_pass(fake_gpus, tmp_path):
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", *CPU_TESTS]
    r = _run(cmd, fake_gpus, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    assert " passed" in r.stdout and "deselected" in r.stdout


PROBE_MODULE = textwrap.dedent("""
    # written by tests/test_gpu_simulated.py: what gloo ranks on a GPU box say about where they ran
    import torch

    def probe():
        from ddp_lib.bench.allreduce import machine_label
        from ddp_lib.course.results import machine
        from ddp_lib.devices import comm_device, ranks_use_cuda
        from ddp_lib.apps.resume import _rng_state
        from ddp_lib.kit.profiling import profile_steps

        prof = profile_steps(lambda: torch.randn(16, 16) @ torch.randn(16, 16), steps=1, warmup=0, trace_path=None)
        return [str(comm_device()), ranks_use_cuda(), machine(), machine_label(), prof.device, sorted(_rng_state())]
""")


@BOTH
def test_gloo_ranks_report_the_cpu_where_gpus_are_visible(fake_gpus, tmp_path):
    """Profiling and the machine a result names follow the ranks' communication device, not the GPUs in the box
    (asking CUDA for its device name or a synchronize would fail here, as the simulated GPUs are not real)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "gloo_probe.py").write_text(PROBE_MODULE)
    code = ("from ddp_lib.launch import run_on_ranks; import gloo_probe;"
            "print(run_on_ranks(gloo_probe.probe, 2, backend='gloo'))")
    r = _run([sys.executable, "-c", code], fake_gpus, tmp_path, timeout_s=300)
    assert r.returncode == 0, r.stdout[-4000:]
    device, on_cuda, machine, label, profiled, rng = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own print
    assert (device, on_cuda, profiled) == ("cpu", False, "cpu")
    assert rng == ["python", "torch"]  # a resumable checkpoint holds no stream of GPUs the ranks never used
    assert machine.startswith("CPU (") and "-core CPU (" in label, (machine, label)
