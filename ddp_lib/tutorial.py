"""Run the tutorial headless: execute notebooks/NN_*.ipynb in order, in place, outputs kept and sanitised.

    python -m ddp_lib.tutorial                # every lesson
    python -m ddp_lib.tutorial 02 05          # lessons whose file name starts with these numbers
    python -m ddp_lib.tutorial --check        # execute into a temp copy, leave the committed files alone
    python -m ddp_lib.tutorial --sync-mirrors # copy each mirrored ddp_lib file into its `mirror:` cell, run nothing
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


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


def execute(path: Path, out_path: Path | None = None, timeout: int = 600) -> float:
    """Execute one notebook with the current interpreter's kernel; return wall seconds."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # the kernel inherits it: no debugpy warning
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = time.perf_counter() - start
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lessons", nargs="*", help="lesson numbers to run (default: all)")
    parser.add_argument("--check", action="store_true", help="execute into a temp dir, keep the committed notebooks")
    parser.add_argument("--timeout", type=int, default=600, help="per-cell timeout in seconds")
    parser.add_argument("--sync-mirrors", action="store_true",
                        help="copy the package files into the lessons' mirror cells (no execution), then stop")
    args = parser.parse_args(argv)
    paths = lesson_paths(args.lessons)
    if args.sync_mirrors:
        changed = sync_mirrors(paths)
        print("\n".join(changed) if changed else "every mirror cell already equals its file")
        return 0
    if not paths:
        print("no lesson notebooks found: running the engines demo instead")
        from ddp_lib.demo import main as demo

        return demo()
    total = 0.0
    for path in paths:
        out = None
        if args.check:
            import tempfile

            out = Path(tempfile.mkdtemp()) / path.name
        print(f"executing {path.relative_to(ROOT)} ...", flush=True)
        seconds = execute(path, out, args.timeout)
        total += seconds
        print(f"  done in {seconds:.1f} s", flush=True)
    print(f"{len(paths)} notebooks executed in {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
