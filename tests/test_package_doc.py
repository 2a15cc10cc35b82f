"""docs/package.md is drawn from the code: every module its map names exists, and every root module and subpackage
(gpusim included) is in the map, itself or through its modules."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "package.md"
PKG = ROOT / "ddp_lib"


def mapped(text: str) -> list[str]:
    """The dotted names in the first column of the module map's table."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| `"):
            names += re.findall(r"`(ddp_lib(?:\.\w+)*)`", line.split(" | ")[0])
    return names


def exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def must_be_listed() -> set[str]:
    """Every root module and every subpackage, by dotted name."""
    root = {f"ddp_lib.{p.stem}" for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__")}
    return root | {f"ddp_lib.{p.name}" for p in PKG.iterdir() if (p / "__init__.py").is_file()}


def test_every_module_the_map_names_exists():
    names = mapped(DOC.read_text(encoding="utf-8"))
    assert names and not [n for n in names if not exists(n)]


def test_every_root_module_and_subpackage_is_in_the_map():
    names = mapped(DOC.read_text(encoding="utf-8"))
    missing = {m for m in must_be_listed() if not any(n == m or n.startswith(m + ".") for n in names)}
    assert not missing, f"docs/package.md's module map lacks {sorted(missing)}"


def test_the_check_sees_a_stale_and_a_missing_row():
    doc = "## Module map\n\n| module | holds |\n|---|---|\n| `ddp_lib.gone` | gone |\n| `ddp_lib.comm` | x |\n"
    assert mapped(doc) == ["ddp_lib.gone", "ddp_lib.comm"]
    assert not exists("ddp_lib.gone") and exists("ddp_lib.comm") and exists("ddp_lib.gpusim")
    assert "ddp_lib.gpusim" in must_be_listed() - set(mapped(doc))
