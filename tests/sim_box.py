"""Run code on the simulated GPU box (ddp_lib.gpusim) in a subprocess and read back the result it prints.

The simulation installs itself before torch is imported, so never in pytest's own process: the child imports
ddp_lib first, runs, and prints `RESULT <repr>` last. It runs in a session of its own, so that on a timeout the
whole session (its ranks too) is ended by its id, and nothing else.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_in_session(cmd: list[str], env: dict[str, str], timeout_s: float,
                   what: str | None = None) -> subprocess.CompletedProcess:
    """`cmd` from the checkout's root in a new session, stdout and stderr together; fails the test on a timeout."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"{what or cmd} did not finish within {timeout_s:.0f} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def sim_result(code: str, *args: str, timeout_s: float, dry: bool = False) -> object:
    """`python -c code *args` on a simulated 2xT4 (`dry`: in dry mode); the value of its last `RESULT ` line."""
    if not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no C++ compiler: ddp_lib.gpusim compiles its CUDA guard shim once (apt-get install g++)")
    env = dict(os.environ, DDP_GPU_SIM="2xT4", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("DDP_GPU_SIM_DRY", None)
    if dry:
        env["DDP_GPU_SIM_DRY"] = "1"
    done = run_in_session([sys.executable, "-c", code, *args], env, timeout_s,
                          f"the {'dry ' if dry else ''}simulated box")
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-4000:]
    return ast.literal_eval(lines[-1][len("RESULT "):])
