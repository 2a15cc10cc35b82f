"""On a 1-GPU box `%dist_init -n 2` falls back to gloo on the CPU, and those ranks cannot reach CUDA at all.

Before, the CPU ranks still saw the GPU: torch's PowerSGD hook calls `torch.cuda.synchronize(device)` whenever
`torch.cuda.is_available()` (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py), here with the ranks'
CPU device, and lesson 09 stopped at its PowerSGD cell ("Expected a cuda device, but got: cpu"). A real kernel on a
simulated 1xH100 (ddp_lib.gpusim) runs the learner's line and a torch DDP step with PowerSGD on its ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _nbkernel import Kernel  # noqa: E402

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

POWER_SGD_STEP = """%%distributed
import os
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 8))
model.register_comm_hook(psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                             start_powerSGD_iter=2), psgd.powerSGD_hook)
for _ in range(3):  # the third step compresses (start_powerSGD_iter=2)
    model(torch.randn(4, 8)).sum().backward()
print("ranks:", device, torch.cuda.is_available(), torch.cuda.device_count(), os.environ["CUDA_VISIBLE_DEVICES"] == "")
"""


@pytest.fixture
def one_gpu_kernel(tmp_path, monkeypatch):
    """A kernel on a simulated 1xH100 box, its extension loaded."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the kernel sees the whole simulated box
    k = Kernel(tmp_path, env={"DDP_GPU_SIM": "1xH100", "DDP_SMALL": "1"})
    try:
        r = k.run("%load_ext ddp_lib.notebook", timeout=300)  # imports ddp_lib: the simulation, then torch
        assert r.status == "ok", r.text
        yield k
    finally:
        k.close()


@pytest.mark.gpusim
def test_cpu_ranks_on_a_one_gpu_box_cannot_reach_cuda(one_gpu_kernel):
    k = one_gpu_kernel
    r = k.run("%dist_init -n 2", timeout=300)
    assert r.status == "ok", r.text
    assert "CPU ranks, not GPUs" in r.stderr and "only 1 GPU(s) visible for 2 ranks" in r.stderr, r.stderr
    assert "(gloo): rank 0 -> cpu, rank 1 -> cpu" in r.stdout, r.stdout
    r = k.run(POWER_SGD_STEP, timeout=300)
    assert r.status == "ok", r.text
    assert r.stdout.count("ranks: cpu False 0 True") == 2, r.stdout
    # the kernel itself still has its GPU: only the ranks, which compute on the CPU, are kept away from it
    assert k.run("%dist_mode -d").status == "ok"
    r = k.run("import torch; print('kernel:', torch.cuda.device_count())", timeout=120)
    assert r.status == "ok" and "kernel: 1" in r.stdout, r.text
    assert k.run("%dist_shutdown", timeout=60).status == "ok"
