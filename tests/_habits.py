"""A lesson in a real kernel, driven the way a learner drives it: cells by id, re-runs, the stop button, a restart.

    lk = LessonKernel("05", tmp_path)          # 2 gloo ranks once its first cells run; the suite's environment
    lk.run("c01", "c02")                         # cells by id, in the order given
    lk.run_cell("c19", interrupt_after_s=3)      # the stop button (SIGINT to the kernel) 3 s after sending it
    left = lk.restart()                          # JupyterLab's restart: old processes alive 15 s later
    lk.close()

The environment is pyproject.toml's pytest env (offline, DDP_NBVAL=1, no live view) with DDP_SMALL=1, so a lesson
runs at the sizes the suite executes it at. tests/habits_walk.py walks a lesson by hand with these habits.
"""

from __future__ import annotations

import threading
from pathlib import Path

import nbformat

from tests._nbkernel import Kernel, Reply, kernel_helpers, wait_gone

ROOT = Path(__file__).resolve().parents[1]


def suite_env() -> dict[str, str]:
    """pyproject.toml's pytest `env` lines, plus DDP_SMALL=1: the lessons' sizes under the suite."""
    env = {"DDP_SMALL": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1"}
    text = (ROOT / "pyproject.toml").read_text().split("env = [", 1)[1].split("]", 1)[0]
    for line in text.splitlines():
        line = line.strip().strip(",").strip('"')
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    return env


class LessonKernel:
    """One lesson notebook and a kernel started in notebooks/, as JupyterLab starts it."""

    def __init__(self, lesson: str, root: Path, env: dict | None = None) -> None:
        self.path = next((ROOT / "notebooks").glob(f"{lesson}_*.ipynb"))
        nb = nbformat.read(self.path, as_version=4)
        self.cells = {c.get("id"): c for c in nb.cells if c.cell_type == "code"}
        self.order = list(self.cells)
        self.kernel = Kernel(root, cwd=ROOT / "notebooks", env={**suite_env(), **(env or {})})

    def run_cell(self, cell_id: str, timeout: float = 420.0, interrupt_after_s: float | None = None) -> Reply:
        """Run one cell; with `interrupt_after_s`, interrupt the kernel that long after sending it."""
        timer = threading.Timer(interrupt_after_s, self.kernel.km.interrupt_kernel) if interrupt_after_s else None
        try:
            return self.kernel.run(self.cells[cell_id].source, timeout=timeout,
                                   on_sent=timer.start if timer else None)
        finally:
            if timer:
                timer.cancel()

    def run(self, *cell_ids: str, timeout: float = 420.0) -> list[Reply]:
        """Run cells in the order given; stop at the first that fails, which is returned last."""
        replies = []
        for cid in cell_ids:
            replies.append(self.run_cell(cid, timeout))
            if replies[-1].status != "ok":
                break
        return replies

    def up_to(self, cell_id: str) -> list[str]:
        """The ids of the code cells from the first to `cell_id`, in notebook order."""
        return self.order[:self.order.index(cell_id) + 1]

    def restart(self, grace_s: float = 15.0) -> list[int]:
        """Restart the kernel (shutdown request with restart=True, then a new kernel on the same connection); return
        the old kernel's descendants (ranks, fork server, resource tracker) still alive `grace_s` later."""
        k = self.kernel
        before = set(k.worker_pids()) | kernel_helpers(k.pid)
        k.km.restart_kernel(now=False)
        k.pid = k.km.provisioner.process.pid
        k.kc.stop_channels()
        k.kc = k.km.client()
        k.kc.start_channels()
        k.kc.wait_for_ready(timeout=60)
        return wait_gone(list(before), grace_s)

    def close(self) -> None:
        """Shut the kernel down and end whatever it started (by PID)."""
        self.kernel.close()


def text(replies: list[Reply] | Reply) -> str:
    """Everything the replies showed, as text."""
    return "".join(r.text for r in (replies if isinstance(replies, list) else [replies]))
