"""Run the tutorial headless: execute notebooks/NN_*.ipynb in order, outputs kept and sanitised.

    python -m ddp_lib.course.tutorial                # every lesson, executed copies in runs/tutorial/
    python -m ddp_lib.course.tutorial 02 05          # lessons whose file name starts with these numbers
    python -m ddp_lib.course.tutorial --out DIR      # executed copies in DIR instead
    python -m ddp_lib.course.tutorial --in-place     # rewrite the committed notebooks, copy the results this run saved
                                              # to assets/results/, regenerate the learner copies
    python -m ddp_lib.course.tutorial --sync-mirrors # copy each mirrored ddp_lib file into its `mirror:` cell, run nothing

Each lesson runs with notebooks/ as its working directory wherever its output goes, so its relative
paths (../assets, ../runs) mean the same in every mode.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
DEFAULT_OUT = ROOT / "runs" / "tutorial"


def lesson_paths(selected: list[str] | None = None, folder: Path = NOTEBOOKS) -> list[Path]:
    """The lesson notebooks, in lesson order, optionally only those whose name starts with a selector."""
    paths = sorted(p for p in folder.glob("[0-9][0-9]_*.ipynb"))
    if selected:
        paths = [p for p in paths if any(p.name.startswith(s) for s in selected)]
    return paths


def sanitise_text(text: str) -> str:
    """Replace machine-specific paths (repo root, home, temp, venv) with neutral placeholders."""
    replacements = [(str(ROOT), "<repo>"), (sys.prefix, "<env>"), (str(Path.home()), "~")]
    for old, new in replacements:
        if old and old not in ("/", "."):
            text = text.replace(old, new)
    text = re.sub(r"/tmp/[\w./-]+", "<tmp>", text)
    text = re.sub(r"0x[0-9a-f]{8,}", "0x…", text)  # object addresses in reprs
    return text


def sanitise(nb) -> None:
    """Strip volatile and machine-specific bits from an executed notebook, in place."""
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = sanitise_text(out["text"])
            if "traceback" in out:
                out["traceback"] = [sanitise_text(t) for t in out["traceback"]]
            for key in ("text/plain", "text/html", "text/markdown"):
                data = out.get("data", {})
                if key in data:
                    value = data[key]
                    data[key] = sanitise_text("".join(value) if isinstance(value, list) else value)


def cell_seconds(nb) -> list[tuple[int, float]]:
    """(cell index, seconds) of every executed code cell, from the timestamps nbclient records (before `sanitise`)."""
    from datetime import datetime

    times = []
    for i, cell in enumerate(nb.cells):
        ex = cell.metadata.get("execution", {})
        began, ended = ex.get("iopub.execute_input"), ex.get("shell.execute_reply")
        if began and ended:
            times.append((i, (datetime.fromisoformat(ended.replace("Z", "+00:00"))
                              - datetime.fromisoformat(began.replace("Z", "+00:00"))).total_seconds()))
    return times


def execute(path: Path, out_path: Path | None = None, timeout: int = 600, cwd: Path | None = None,
            edit=None, times: list | None = None) -> float:
    """Execute one notebook with the current interpreter's kernel; return wall seconds.

    `cwd`: the kernel's working directory (default: the notebook's folder). `edit`: a function applied to the
    notebook before it runs (ddp_lib.gpusim.run sets the ranks' count). With `out_path`, a cell's error still
    writes the notebook executed so far there before the error propagates. `times`: a list that receives
    `cell_seconds` of the run.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from jupyter_client.manager import KernelManager

    from ddp_lib.notebook.kernels import on_ipc

    nb = nbformat.read(path, as_version=4)
    if edit is not None:
        edit(nb)
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # the kernel inherits it: no debugpy warning
    km = on_ipc(KernelManager)(kernel_name="python3")  # Unix sockets: no port to race for (ddp_lib.notebook.kernels)
    start = time.perf_counter()
    try:
        NotebookClient(nb, km=km, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(cwd or path.parent)}}).execute()
    except CellExecutionError:
        if out_path is not None:  # what ran, up to the failing cell and its error, for the caller to read
            sanitise(nb)
            nbformat.write(nb, out_path)
        raise
    finally:
        # nbclient shuts down only a kernel it started itself: this one would idle on until the run ends (each
        # lesson's, one after another), then say "Parent appears to have exited"
        if km.has_kernel:
            km.shutdown_kernel(now=False)
        km.remove_sockets()
    elapsed = time.perf_counter() - start
    if times is not None:
        times.extend(cell_seconds(nb))
    sanitise(nb)
    nbformat.write(nb, out_path or path)
    return elapsed


MIRROR_TAG = "mirror:"
MIRROR_MAGIC = "%%distributed\n"


def sync_mirrors(paths: list[Path]) -> list[str]:
    """Rewrite every `mirror:<file>` cell as `%%distributed` + that file's text; return the cells changed."""
    import nbformat

    changed = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        dirty = False
        for cell in nb.cells:
            for tag in cell.get("metadata", {}).get("tags", []):
                if cell.cell_type == "code" and tag.startswith(MIRROR_TAG):
                    rel = tag[len(MIRROR_TAG):]
                    source = MIRROR_MAGIC + (ROOT / rel).read_text(encoding="utf-8").rstrip("\n")
                    if cell.source != source:
                        cell.source, dirty = source, True
                        changed.append(f"{path.name}: {rel}")
        if dirty:
            nbformat.write(nb, path)
    return changed


def copy_results(since: float, src: Path | None = None, dst: Path | None = None) -> list[Path]:
    """Copy the result files written at or after `since` (epoch seconds) from runs/results/ to assets/results/."""
    from ddp_lib.course import results

    src, dst = src or results.RUNS, dst or results.COMMITTED
    fresh = sorted(p for p in src.glob("*.json") if p.stat().st_mtime >= since) if src.is_dir() else []
    if fresh:
        dst.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(p, dst / p.name)) for p in fresh]


def regenerate_exercises() -> int | None:
    """Run `python -m ddp_lib.course.exercises` (the learner copies) when that module exists; its exit status, or None."""
    if importlib.util.find_spec("ddp_lib.course.exercises") is None:
        return None
    return subprocess.run([sys.executable, "-m", "ddp_lib.course.exercises"], cwd=ROOT, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lessons", nargs="*", help="lesson numbers to run (default: all)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=DEFAULT_OUT,
                       help="folder for the executed copies (default: runs/tutorial/, ignored by git)")
    where.add_argument("--in-place", action="store_true",
                       help="rewrite the committed notebooks, copy this run's results to assets/results/, "
                            "regenerate the learner copies")
    where.add_argument("--check", action="store_true", help="execute into a temp dir (kept for old scripts)")
    parser.add_argument("--timeout", type=int, default=600, help="per-cell timeout in seconds")
    parser.add_argument("--cell-times", type=float, metavar="S", default=None,
                        help="after each lesson, print every code cell that took S seconds or more")
    parser.add_argument("--sync-mirrors", action="store_true",
                        help="copy the package files into the lessons' mirror cells (no execution), then stop")
    args = parser.parse_args(argv)
    paths = lesson_paths(args.lessons, NOTEBOOKS)  # read at call time: tests point it elsewhere
    if args.sync_mirrors:
        changed = sync_mirrors(paths)
        print("\n".join(changed) if changed else "every mirror cell already equals its file")
        return 0
    if not paths:
        print("no lesson notebooks found: running the engines demo instead")
        from ddp_lib.course.demo import main as demo

        return demo()
    if args.check:
        args.out = Path(tempfile.mkdtemp(prefix="ddp_tutorial_"))
    out_dir = None if args.in_place else args.out.resolve()
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    started, total = time.time(), 0.0
    for path in paths:
        out = None if out_dir is None else out_dir / path.name
        print(f"executing {_show(path)} -> {_show(out or path)} ...", flush=True)
        times: list[tuple[int, float]] = []
        seconds = execute(path, out, args.timeout, times=times)
        total += seconds
        print(f"  done in {seconds:.1f} s", flush=True)
        if args.cell_times is not None:
            slow = [f"[{i}] {s:.1f}" for i, s in times if s >= args.cell_times]
            print(f"  cells of {args.cell_times:g} s or more (index, seconds): {', '.join(slow) or 'none'}; "
                  f"all code cells {sum(s for _, s in times):.1f} s", flush=True)
    print(f"{len(paths)} notebooks executed in {total:.1f} s")
    if args.in_place:
        copied = copy_results(started)
        print(f"results copied to assets/results/: {', '.join(p.name for p in copied) or 'none written'}")
        status = regenerate_exercises()
        if status is None:
            print("no ddp_lib.course.exercises module: learner copies not regenerated")
        elif status != 0:
            print(f"python -m ddp_lib.course.exercises failed with exit status {status}", file=sys.stderr)
            return status
    return 0


def _show(path: Path) -> str:
    """`path` relative to the repository when it is inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
