"""Lessons and package cannot drift: each lesson's `mirror:` cells equal the ddp_lib files they show."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
TAG = "mirror:"
MAGIC = "%%distributed\n"

# the modules each lesson must show in full, as its final code
REQUIRED: dict[str, list[str]] = {
    "00": ["ddp_lib/devices.py", "ddp_lib/mesh.py"],
    "02": ["ddp_lib/ddp/simple.py"],
    "04": ["ddp_lib/ddp/strategy.py", "ddp_lib/contract.py", "ddp_lib/ddp/naive.py", "ddp_lib/ddp/flat.py"],
    "05": ["ddp_lib/ddp/overlap.py", "ddp_lib/ddp/bucketed.py", "ddp_lib/ddp/bucket.py", "ddp_lib/ddp/per_bucket.py"],
    "07": ["ddp_lib/zero.py"],
    "08": ["ddp_lib/fsdp/unit_group.py", "ddp_lib/fsdp/fully_sharded.py"],
}


def lesson_notebooks() -> list[Path]:
    """The lesson notebooks present now (NN_*.ipynb)."""
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def mirror_cells(path: Path) -> list[tuple[str, str]]:
    """(mirrored file, cell source) for every code cell tagged `mirror:<path>`."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    found = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        for tag in cell.get("metadata", {}).get("tags", []):
            if tag.startswith(TAG):
                found.append((tag[len(TAG):], source))
    return found


def _one(lesson: str) -> Path | None:
    matches = [p for p in lesson_notebooks() if p.name.startswith(lesson + "_")]
    assert len(matches) <= 1, f"more than one notebook for lesson {lesson}: {[p.name for p in matches]}"
    return matches[0] if matches else None


@pytest.mark.parametrize("lesson", sorted(REQUIRED))
def test_lesson_has_its_mirrors(lesson: str) -> None:
    """A present lesson notebook carries a mirror cell for every module it is meant to show."""
    path = _one(lesson)
    assert path is not None, f"no notebook for lesson {lesson} in notebooks/"
    shown = {rel for rel, _ in mirror_cells(path)}
    missing = [rel for rel in REQUIRED[lesson] if rel not in shown]
    assert not missing, f"{path.name} has no mirror cell for {missing} (tag a cell 'mirror:<path>')"


@pytest.mark.parametrize("path", [p for p in lesson_notebooks() if mirror_cells(p)], ids=lambda p: p.name)
def test_mirror_cells_equal_package_source(path: Path) -> None:
    """Every `mirror:` cell is `%%distributed` followed by the file's text, character for character."""
    for rel, source in mirror_cells(path):
        target = ROOT / rel
        assert target.is_file(), f"{path.name}: mirror tag names {rel}, which does not exist"
        assert source.startswith(MAGIC), f"{path.name}: the mirror cell of {rel} must start with {MAGIC!r}"
        shown = source[len(MAGIC):].rstrip("\n")
        actual = target.read_text(encoding="utf-8").rstrip("\n")
        if shown != actual:
            a, b = shown.splitlines(), actual.splitlines()
            line = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            detail = (f"first difference at line {line + 1}:\n  notebook: {a[line] if line < len(a) else '<end>'!r}"
                      f"\n  package:  {b[line] if line < len(b) else '<end>'!r}")
            pytest.fail(f"{path.name}: the cell mirroring {rel} differs from the file; {detail}")


def test_mirror_check_catches_drift(tmp_path: Path) -> None:
    """The comparison itself: a one-character change is reported."""
    nb = {"cells": [{"cell_type": "code", "metadata": {"tags": ["mirror:ddp_lib/mesh.py"]},
                     "source": MAGIC + (ROOT / "ddp_lib/mesh.py").read_text().replace("ws", "WS", 1)}]}
    p = tmp_path / "00_x.ipynb"
    p.write_text(json.dumps(nb))
    with pytest.raises(pytest.fail.Exception, match="differs from the file"):
        test_mirror_cells_equal_package_source(p)
