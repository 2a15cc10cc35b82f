"""Lesson 01's `check_allreduce_timing` on a simulated 2xT4 under NCCL (ddp_lib.gpusim): NCCL's `wait()` does not block
the host there, so a timing that reads the clock without draining the device fails "the device drained", while the
lesson's answer (torch.cuda.synchronize) and one timed with CUDA events pass. The gloo mutation suite of this checker
(tests/test_check_mutations_early.py) cannot show it: on the CPU a collective is done when it returns.

Run as a script, this file is the simulated process (`import ddp_lib` first); pytest runs it once in a subprocess.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import pytest

from sim_box import sim_result

# starts the simulated GPU box, which needs torch's CPU build: skipped with the reason on a CUDA build
pytestmark = pytest.mark.gpusim

ROOT = Path(__file__).resolve().parent.parent
LIMIT_S = 60.0


def time_allreduce(x, iters, warmup, sync=True):
    """The lesson's answer; `sync=False` plants the mistake: the clock read before the device drained."""
    import torch
    import torch.distributed as dist

    def drain():
        if sync and x.is_cuda:
            torch.cuda.synchronize(x.device)

    for _ in range(warmup):
        dist.all_reduce(x)
    drain()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        drain()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=x.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


def time_with_events(x, iters, warmup):
    """Right, another way: CUDA events around each call, the end one synchronized."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    slowest = torch.tensor(times, dtype=torch.float64, device=x.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return statistics.median(slowest.tolist())


CASES = {
    "right: synchronize": time_allreduce,
    "right: CUDA events": time_with_events,
    "no synchronize": lambda x, i, w: time_allreduce(x, i, w, sync=False),
}


def on_ranks() -> dict:
    """Each rank: every case through the checker, and how long an un-synced all-reduce reads on the host clock."""
    import torch
    import torch.distributed as dist

    from ddp_lib.check.allreduce_timing import check_allreduce_timing

    sys.path.insert(0, str(ROOT / "tests"))
    from _mutations import run_case, warm_up

    warm_up()
    out = {name: run_case(check_allreduce_timing, fn, timeout_s=LIMIT_S) for name, fn in CASES.items()}
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    torch.cuda._sleep(int(2.0 * 1e9))  # the GPU busy for 2 s (1 GHz, gpusim's): the host goes on
    t0 = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    out["unsynced_s"] = time.perf_counter() - t0
    torch.cuda.synchronize()
    out["synced_total_s"] = time.perf_counter() - t0
    out["value"] = x[0].item()
    return out


def main() -> None:
    """Print the ranks' results."""
    from ddp_lib.launch import spawn

    print("RESULT", repr(spawn(on_ranks, 2, backend="nccl", timeout_s=400)), flush=True)


@pytest.fixture(scope="module")
def ranks() -> list:
    """Both ranks' results, from one simulated 2xT4."""
    return sim_result("import ddp_lib, test_gpusim_timing; test_gpusim_timing.main()", timeout_s=500)


@pytest.mark.parametrize("case", ["right: synchronize", "right: CUDA events"])
def test_right_answers_pass_under_simulated_nccl(ranks, case):
    for r in ranks:
        assert r[case]["failed"] == [] and r[case]["passed"], r[case]["table"]


def test_no_synchronize_fails_the_device_drained(ranks):
    from _mutations import assert_one_diagnosis

    for r in ranks:
        assert_one_diagnosis(r["no synchronize"], "the device drained", "before the device finished")


def test_nccl_wait_does_not_block_the_host_but_synchronize_does(ranks):
    for r in ranks:
        # the 2 s spin is queued before the all-reduce; only a synchronize waits for it (1 s: room for a loaded box)
        assert r["unsynced_s"] < 1.0 < 2.0 <= r["synced_total_s"]
        assert r["value"] == 4.0  # two all-reduces of ones on 2 ranks: the data arrived before it was read
