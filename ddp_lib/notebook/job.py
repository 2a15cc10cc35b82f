"""A launcher (torchrun, srun) run from a notebook cell: however the wait ends, its ranks end with it.

`subprocess.run` stopped by an interrupt or its timeout SIGKILLs the launcher alone; torchrun starts each rank in a
session of its own, so the ranks live on, orphaned (still training, or waiting up to their process group's timeout
for the store that died with torchrun). `run_job` ends the whole tree instead, each process by its PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from ddp_lib.launch import descendants


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended: its parent has not reaped it
    except (OSError, IndexError):
        return False


def end_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End `proc` and every process below it: SIGTERM (torchrun forwards it to its ranks), then SIGKILL after
    `grace_s` to whatever is left. The tree is read before each signal and remembered, so ranks the launcher leaves
    orphaned when it exits are still ended."""
    tree: set[int] = set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        tree.update(descendants(proc.pid))
        for pid in [proc.pid, *tree]:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                continue
            tree.update(descendants(proc.pid))
            if not any(_alive(p) for p in tree):
                return
        tree.update(descendants(proc.pid))


def run_job(args: list[str], timeout_s: float, grace_s: float = 2.0, **popen_kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)` for a launcher: interrupted or timed
    out, it ends the launcher and all its ranks (`end_tree`) before the exception goes on."""
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException:
            end_tree(proc, grace_s)
            raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
