"""Under torch 2.15's NCCL device rule (simulated: DDP_GPU_SIM_NCCL2=1, ddp_lib.gpusim._nccl2) every group the course
makes on GPUs gets its device from `device_id`: `%dist_init`'s ranks, `ddp_lib.launch.spawn`'s, the exported script's
prologue under torchrun, and the meshes `get()` reads groups from.

In 2.15 a group made without `device_id` takes `LOCAL_RANK`'s GPU (torch/distributed/distributed_c10d.py,
`_nccl2_device`, lines 820-849). The course's launchers set LOCAL_RANK to each rank's GPU, so such a group would
still land right there; a launcher that gives two ranks one LOCAL_RANK puts them on one GPU, which NCCL refuses. The
records say where each group's device came from, so a group made without `device_id` fails the check whichever GPU
it took. One subprocess on a simulated 2xT4 runs tests/gpusim_nccl2_cases.py: 2 ranks from spawn (about 15 CPU s with
the %dist_init ranks below on the 2-core VM, loaded by other jobs, hence `slow`), then `%dist_init -n 2` in an
in-process IPython shell.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.gpusim, pytest.mark.slow, pytest.mark.timeout(450)]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict:
    """Run the cases once on a simulated 2xT4 box under 2.15's rule; their records, as printed on the last line."""
    tmp = tmp_path_factory.mktemp("nccl2")
    env = dict(os.environ, DDP_GPU_SIM="2xT4", DDP_GPU_SIM_NCCL2="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for name in ("CUDA_VISIBLE_DEVICES", "TORCH_DIST_USE_NCCL2"):
        env.pop(name, None)
    code = "import ddp_lib, gpusim_nccl2_cases, sys; gpusim_nccl2_cases.main(sys.argv[1])"  # ddp_lib first: the sim
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # its own session: the ranks go with it, nothing else
        out, _ = proc.communicate()
        pytest.fail(f"the simulated box did not finish within 400 s:\n{out[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, out[-4000:]
    return ast.literal_eval(lines[-1][len("RESULT "):])


def bound_by_device_id(per_rank: list[dict]) -> None:
    """Raise unless each rank's group took its own GPU, cuda:<rank>, from `device_id`."""
    for rank, rec in enumerate(per_rank):
        if rec["origin"] != "device_id" or rec["device"] != f"cuda:{rank}":
            raise AssertionError(f"rank {rank}'s group took {rec['device']} from {rec['origin']}, not from device_id")


def test_spawn_ranks_pass_device_id(records):
    bound_by_device_id([r["spawn"] for r in records["ranks"]])


def test_dist_init_ranks_pass_device_id(records):
    bound_by_device_id(records["dist_init"])


def test_the_exported_prologue_passes_device_id(records):
    bound_by_device_id([r["export"] for r in records["ranks"]])


def test_every_group_of_gets_meshes_has_the_ranks_gpu_from_device_id(records):
    names = set(records["ranks"][0]["meshes"])
    assert names == {"dp/dp", "dp_tp/dp", "dp_tp/tp", "hsdp/replicate", "hsdp/shard"}, names
    for name in sorted(names):
        bound_by_device_id([r["meshes"][name] for r in records["ranks"]])


def test_a_planted_group_without_device_id_fails_the_check(records):
    # init_distributed with device_id dropped: 2.15 binds LOCAL_RANK's GPU, the right one here, and the check refuses it
    planted = [r["planted"] for r in records["ranks"]]
    assert [p["device"] for p in planted] == ["cuda:0", "cuda:1"]
    with pytest.raises(AssertionError, match="from LOCAL_RANK, not from device_id"):
        bound_by_device_id(planted)


def test_the_rule_takes_local_ranks_gpu_and_refuses_two_ranks_on_one(records):
    assert [r["derived"] for r in records["ranks"]] == [{"origin": "LOCAL_RANK", "device": f"cuda:{k}"} for k in (0, 1)]
    for r in records["ranks"]:  # both ranks refuse, so neither waits for the other
        assert r["duplicate"].startswith("DistBackendError: NCCL error: invalid usage"), r["duplicate"]
        assert "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0" in r["duplicate"], r["duplicate"]
