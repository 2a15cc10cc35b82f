"""Walk a lesson through a real kernel with a learner's habits, by hand, and print what each cell showed.

    PYTHONPATH=. python tests/habits_walk.py 05 run:1-10 twice:10 int:28@8 run:30 restart run:19 run:66 gone

Cells are the notebook's cell indices (nbformat order, markdown included). Steps:
  run:A-B / run:A   run the code cells with indices A..B in order     twice:A   run cell A twice in a row
  int:A@S           run cell A, press stop (SIGINT to the kernel) S s after sending it, list the ranks after
  restart           restart the kernel; print the old kernel's processes still alive 15 s later (should be none)
  ranks / sleep:S   list the processes below the kernel / wait S seconds
  gone              print the processes seen since the last restart still alive 15 s later (after %dist_shutdown)
Each cell is bounded (HABITS_CELL_LIMIT, 420 s); one over it ends the walk (exit 1).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests._habits import LessonKernel  # noqa: E402
from tests._nbkernel import kernel_helpers, wait_gone  # noqa: E402

LIMIT = float(os.environ.get("HABITS_CELL_LIMIT", "420"))


def shown(text: str, n: int = 700) -> str:
    """The cell's output without colour codes, its middle cut past `n` characters, indented."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    text = text if len(text) <= n else text[:n // 2] + "\n[...]\n" + text[-n // 2:]
    return "    " + text.rstrip().replace("\n", "\n    ") if text.strip() else ""


def main(argv: list[str]) -> int:
    """Run the steps of argv[1:] on lesson argv[0]; 0 when every cell returned within the limit."""
    lesson, steps = argv[0], argv[1:]
    lk = LessonKernel(lesson, Path(tempfile.mkdtemp(prefix=f"habits{lesson}_")))
    by_index = {i: c.get("id") for i, c in enumerate(nbformat.read(lk.path, 4).cells) if c.cell_type == "code"}
    seen: set[int] = set()

    def run(i: int, label: str, stop_s: float | None = None) -> bool:
        try:
            r = lk.run_cell(by_index[i], timeout=LIMIT, interrupt_after_s=stop_s)
        except Exception as e:  # noqa: BLE001 - no reply within the limit
            print(f"[{i}] {by_index[i]} {label}: no reply within {LIMIT:.0f} s ({type(e).__name__})", flush=True)
            return False
        seen.update(lk.kernel.worker_pids())
        print(f"[{i}] {by_index[i]} {label}: {r.status} in {r.elapsed:.1f} s", flush=True)
        if out := shown(r.text):
            print(out, flush=True)
        return True

    try:
        for step in steps:
            kind, _, arg = step.partition(":")
            print(f"== {step}", flush=True)
            if kind == "run":
                a, _, b = arg.partition("-")
                if not all(run(i, "run") for i in sorted(by_index) if int(a) <= i <= int(b or a)):
                    return 1
            elif kind == "twice":
                if not (run(int(arg), "run 1/2") and run(int(arg), "run 2/2")):
                    return 1
            elif kind == "int":
                i, _, s = arg.partition("@")
                if not run(int(i), f"stop at {s} s", float(s)):
                    return 1
                print(f"    processes below the kernel after: {lk.kernel.worker_pids()}", flush=True)
            elif kind == "restart":
                print(f"    old kernel's processes alive 15 s after the restart: {lk.restart()}", flush=True)
                seen = set()
            elif kind == "ranks":
                print(f"    processes below the kernel: {lk.kernel.worker_pids()}", flush=True)
            elif kind == "sleep":
                time.sleep(float(arg))
            elif kind == "gone":
                left = wait_gone(list(seen - kernel_helpers(lk.kernel.pid)), 15)
                print(f"    alive 15 s later: {left} (of {sorted(seen)})", flush=True)
            else:
                raise SystemExit(f"unknown step {step!r}")
    finally:
        lk.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
