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


@pytest.mark.slow
# Issue 38, open: in this project's CI run (2-core VM, the suite's other worker busy) 1 of 30 jobs lost rank 0 to
# SIGABRT, "terminate called without an active exception", as CS336's test did; its cause is not found yet. Not
# strict: most runs pass, and the xfail report keeps the abort visible until the fix makes it a plain pass.
@pytest.mark.xfail(reason="issue 38: a rank aborts at teardown in about 1 of 30 loaded runs (not fixed yet)",
                   strict=False)
def test_tied_weights_bucketed_then_destroy_never_aborts():
    script = Path(__file__).with_name("teardown_cases.py")
    done = subprocess.run([sys.executable, str(script), str(RUNS)], capture_output=True, text=True,
                          timeout=120 * RUNS)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0 and last.startswith(f"{RUNS} runs, 0 failed"), (last, done.stderr[-2000:])
