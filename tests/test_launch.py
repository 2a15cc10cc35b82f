"""ddp_lib.launch: ranks never outlive the process that spawned them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has already exited
    except FileNotFoundError:
        return False


def test_ranks_die_when_their_parent_is_killed(tmp_path: Path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, time
        from ddp_lib.launch import spawn

        def hang(folder):
            open(os.path.join(folder, str(os.getpid())), "w").close()
            time.sleep(600)  # as if stuck in a collective

        if __name__ == "__main__":
            spawn(hang, world_size=2, args=({str(tmp_path)!r},), timeout_s=600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
            time.sleep(0.2)
        assert len(pids) == 2, "the ranks did not start"
        parent.send_signal(signal.SIGKILL)  # no atexit, no finally: only the ranks' own guard can act
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "ranks outlived their SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in pids:  # only the processes this test started, by PID
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
