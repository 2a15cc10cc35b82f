"""`python -m ddp_lib.course.tutorial`: executed copies go to an output folder unless --in-place, quiet kernels, results."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from ddp_lib.course import tutorial

sys.path.insert(0, str(Path(__file__).parent))
from _nbkernel import wait_gone  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _lesson(folder: Path, name: str = "00_tiny.ipynb") -> Path:
    """A one-cell lesson that prints its working directory."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import os; print('cwd', os.path.basename(os.getcwd()))")]
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / name)
    return folder / name


def test_default_run_writes_copies_and_leaves_the_lessons_alone(tmp_path, monkeypatch):
    lessons = tmp_path / "notebooks"
    src = _lesson(lessons)
    before = src.read_bytes()
    monkeypatch.setattr(tutorial, "NOTEBOOKS", lessons)
    out = tmp_path / "out"
    assert tutorial.main(["--out", str(out)]) == 0
    assert src.read_bytes() == before, "the committed lesson was rewritten"
    executed = nbformat.read(out / src.name, as_version=4)
    # the copy ran with the lesson's own folder as working directory, so ../assets means the same everywhere
    assert executed.cells[0].outputs[0]["text"].strip() == "cwd notebooks"


def test_in_place_rewrites_the_lesson(tmp_path, monkeypatch):
    lessons = tmp_path / "notebooks"
    src = _lesson(lessons)
    monkeypatch.setattr(tutorial, "NOTEBOOKS", lessons)
    monkeypatch.setattr(tutorial, "copy_results", lambda since: [])
    monkeypatch.setattr(tutorial, "regenerate_exercises", lambda: None)
    assert tutorial.main(["--in-place"]) == 0
    assert nbformat.read(src, as_version=4).cells[0].outputs, "the lesson was not executed in place"


def test_default_output_folder_is_ignored_by_git():
    rel = tutorial.DEFAULT_OUT.relative_to(ROOT)
    ignored = subprocess.run(["git", "check-ignore", "-q", str(rel / "00_x.ipynb")], cwd=ROOT, check=False)
    assert ignored.returncode == 0, f"{rel} is not ignored by git: a learner's run would dirty the tree"


def test_kernel_prints_no_unencrypted_tcp_warning(tmp_path):
    src = _lesson(tmp_path / "notebooks")
    code = ("import sys; from pathlib import Path; from ddp_lib.course.tutorial import execute; "
            f"execute(Path({str(src)!r}), Path({str(tmp_path / 'run.ipynb')!r}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert run.returncode == 0, run.stderr
    assert "without encryption" not in run.stderr, run.stderr


def test_each_lessons_kernel_is_shut_down_when_it_is_done(tmp_path):
    """The kernel of a lesson ends with it, not when the whole run ends (nbclient leaves a kernel it did not start)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import os; print(os.getpid())")]
    (tmp_path / "notebooks").mkdir()
    nbformat.write(nb, src := tmp_path / "notebooks" / "00_pid.ipynb")
    tutorial.execute(src, out := tmp_path / "run.ipynb")
    pid = int(nbformat.read(out, as_version=4).cells[0].outputs[0]["text"])
    assert wait_gone([pid]) == [], f"the lesson's kernel (pid {pid}) is still running after execute() returned"


def test_copy_results_takes_only_this_runs_files(tmp_path):
    src, dst = tmp_path / "runs", tmp_path / "assets"
    src.mkdir()
    old = src / "lesson01_old.json"
    old.write_text("{}")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    since = time.time() - 1
    (src / "lesson05_race.json").write_text('{"x": 1}')
    copied = tutorial.copy_results(since, src, dst)
    assert [p.name for p in copied] == ["lesson05_race.json"]
    assert (dst / "lesson05_race.json").read_text() == '{"x": 1}'
    assert not (dst / "lesson01_old.json").exists()


@pytest.mark.parametrize("flags", [["--in-place", "--out", "x"], ["--in-place", "--check"]])
def test_in_place_and_an_output_folder_exclude_each_other(flags):
    with pytest.raises(SystemExit):
        tutorial.main(flags)


def test_cell_times_prints_the_slow_cells_and_keeps_no_timestamps(tmp_path, monkeypatch, capsys):
    """--cell-times S prints each code cell of S seconds or more; the written copy still has no timestamps."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_markdown_cell("text"),
                nbformat.v4.new_code_cell("import time; time.sleep(0.6)")]
    (tmp_path / "lessons").mkdir()
    nbformat.write(nb, tmp_path / "lessons" / "00_tiny.ipynb")
    monkeypatch.setattr(tutorial, "NOTEBOOKS", tmp_path / "lessons")
    assert tutorial.main(["--out", str(tmp_path / "out"), "--cell-times", "0.5"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "cells of 0.5 s or more" in ln)
    assert re.search(r"\[2\] \d+\.\d", line) and "[0]" not in line, line  # the sleeping cell by its index, not x = 1
    ran = nbformat.read(tmp_path / "out" / "00_tiny.ipynb", as_version=4)
    assert all("execution" not in c.metadata for c in ran.cells)
