"""Words on a lesson's main line: its markdown outside collapsed ``<details>`` blocks."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

from ddp_lib.course.tutorial import NOTEBOOKS, lesson_paths

_WORD = re.compile(r"\w+")

#: The most words a lesson's main line may hold: readable in one sitting.
MAIN_LINE_LIMIT = 3500


def strip_details(text: str) -> str:
    """Return markdown with every ``<details>`` block removed (nested ones with their parent)."""
    out, depth, pos = [], 0, 0
    for m in re.finditer(r"<(/?)details\b[^>]*>", text, re.IGNORECASE):
        if m.group(1):
            if depth:
                depth -= 1
                if depth == 0:
                    pos = m.end()
            continue
        if depth == 0:
            out.append(text[pos:m.start()])
        depth += 1
    if depth == 0:
        out.append(text[pos:])
    # An unclosed block hides the rest of the cell, as a renderer would.
    return "".join(out)


def words(text: str) -> int:
    """Count words as runs of letters, digits and underscores (``\\w+``), as the issue measured: `x.view(-1)` is three."""
    return len(_WORD.findall(text))


def lesson_words(path: Path) -> tuple[int, int]:
    """Return (all markdown words, main-line words) of one lesson."""
    nb = nbformat.read(path, as_version=4)
    md = [c.source for c in nb.cells if c.cell_type == "markdown"]
    return sum(words(s) for s in md), sum(words(strip_details(s)) for s in md)


def table(folder: Path = NOTEBOOKS) -> list[tuple[str, int, int]]:
    """Return (lesson file, all markdown words, main-line words) for every lesson."""
    return [(p.name, *lesson_words(p)) for p in lesson_paths(None, folder)]


def main(argv: list[str] | None = None) -> int:
    """Print the words-per-lesson table; exit 1 when a main line is over the limit."""
    folder = Path(argv[0]) if argv else NOTEBOOKS
    rows = table(folder)
    print(f"{'lesson':40s} {'markdown':>9s} {'main line':>10s}")
    for name, total, main_line in rows:
        flag = "  over" if main_line > MAIN_LINE_LIMIT else ""
        print(f"{name:40s} {total:9d} {main_line:10d}{flag}")
    return int(any(m > MAIN_LINE_LIMIT for _, _, m in rows))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
