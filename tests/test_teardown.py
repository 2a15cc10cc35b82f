"""Tearing the group down right after a BucketedDDP step never aborts a rank (CS336 2025's tied-weights case).

Each run is a fresh 2-rank job (`tests/teardown_cases.py`): 5 steps of a tied-weights model under BucketedDDP
with 0.01 MB buckets, then `dist.barrier(); dist.destroy_process_group()` and a normal interpreter exit, where a
collective, hook future or thread left over from the step would abort the process (SIGABRT, "terminate called
without an active exception"). `TEARDOWN_RUNS` sets how many runs (30 by default).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

RUNS = int(os.environ.get("TEARDOWN_RUNS", "30"))


def test_destroy_frees_the_group_after_an_optimizer():
    # ddp_lib.comm imports torch.distributed.nn.functional before any group exists: loaded later (a torch
    # optimizer's first construction imports torch._dynamo, which imports it), its `group=group.WORLD` defaults
    # would keep the default group, and its gloo threads, alive past destroy_process_group()
    script = Path(__file__).with_name("teardown_cases.py")
    done = subprocess.run([sys.executable, str(script), "--freed"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "freed", done.stdout


@pytest.mark.slow
# Issue 38, open: in this project's CI run (2-core VM, the suite's other worker busy) 1 of 30 jobs lost rank 0 to
# SIGABRT, "terminate called without an active exception", as CS336's test did; its cause is not proven yet. What is
# measured (torch 2.13, gloo, 2 ranks): a torch optimizer's first construction imports torch._dynamo, which takes 10
# references to the default ProcessGroup that gc cannot see (sys.getrefcount(dist.group.WORLD) 9 -> 19), so
# destroy_process_group() does not free the gloo group: its threads (6 per process on rank 0, 5 on rank 1, against
# 2 after the same teardown without an optimizer) live on into interpreter shutdown, where a thread that still
# holds a collective's tensor must take the GIL to free it. The engines now empty their in-flight list before any
# wait (comm.wait_all) and hold no work after finish_gradient_synchronization(), but a pending tensor inside gloo's
# own worker can outlive that by a scheduling slice, which nothing in Python observes. Not strict: most runs pass,
# and the xfail report keeps the abort visible until the fix makes it a plain pass.
@pytest.mark.xfail(reason="issue 38: a rank aborts at teardown in about 1 of 30 loaded runs (cause not proven)",
                   strict=False)
def test_tied_weights_bucketed_then_destroy_never_aborts():
    script = Path(__file__).with_name("teardown_cases.py")
    done = subprocess.run([sys.executable, str(script), str(RUNS)], capture_output=True, text=True,
                          timeout=120 * RUNS)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0 and last.startswith(f"{RUNS} runs, 0 failed"), (last, done.stderr[-2000:])
