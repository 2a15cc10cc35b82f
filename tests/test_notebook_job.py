"""ddp_lib.notebook.job.run_job: a launcher stopped by an interrupt takes its ranks with it, also ranks in sessions of
their own (as torchrun starts them) and ranks that ignore SIGTERM; subprocess.run leaves them running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


from ddp_lib.notebook.job import _alive

# a launcher as torchrun is one: its "ranks" in sessions of their own; the second one ignores SIGTERM
LAUNCHER = textwrap.dedent("""\
    import subprocess, sys, time
    kids = [subprocess.Popen(["sleep", "300"], start_new_session=True),
            subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 300"], start_new_session=True)]
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(" ".join(str(k.pid) for k in kids))
    import os; os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
    """)

# what the lesson's torchrun cell does on rank 0, the interrupt arriving as the magics send it (SIGINT to the rank)
CELL = textwrap.dedent("""\
    import subprocess, sys
    from ddp_lib.notebook.job import run_job
    try:
        if sys.argv[3] == "run_job":
            run_job([sys.executable, sys.argv[1], sys.argv[2]], timeout_s=300)
        else:
            subprocess.run([sys.executable, sys.argv[1], sys.argv[2]], capture_output=True, text=True, timeout=300)
    except KeyboardInterrupt:
        print("interrupted")
    """)


def _interrupt_a_job(tmp_path: Path, how: str) -> tuple[str, list[int]]:
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "cell.py").write_text(CELL)
    pids_file = tmp_path / "pids"
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    cell = subprocess.Popen([sys.executable, "cell.py", "launcher.py", str(pids_file), how], cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=path))
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not pids_file.exists() and time.monotonic() < deadline and cell.poll() is None:
            time.sleep(0.1)
        kids = [int(p) for p in pids_file.read_text().split()]
        cell.send_signal(signal.SIGINT)
        out, _ = cell.communicate(timeout=60)
        time.sleep(0.5)  # an orphan's end is reaped by init
        return out, [p for p in kids if _alive(p)]
    finally:
        cell.kill()
        for p in kids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_interrupted_run_job_ends_the_launchers_ranks(tmp_path):
    out, alive = _interrupt_a_job(tmp_path, "run_job")
    assert "interrupted" in out
    assert alive == [], f"ranks left running after the interrupt: {alive}"


def test_subprocess_run_leaves_them_running(tmp_path):
    """The control: subprocess.run, as the cell ran torchrun before, so the test above can fail."""
    out, alive = _interrupt_a_job(tmp_path, "subprocess.run")
    assert "interrupted" in out and len(alive) == 2
