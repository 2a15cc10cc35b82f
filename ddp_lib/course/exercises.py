"""The learner copies: `python -m ddp_lib.course.exercises [NN ...] [--check]` writes `notebooks/exercises/NN_*.ipynb`.

From each lesson (solutions in place) it makes the copy a learner opens:
- in a code cell tagged `your-turn`, each region between a `### BEGIN SOLUTION` line and a
  `### END SOLUTION` line becomes `raise NotImplementedError("your turn")` at the BEGIN line's indentation;
- every output and execution count is cleared;
- after each cell tagged `check`, a collapsed code cell tagged `solution` (`jupyter.source_hidden`) holds
  the full solution of the your-turn cells since the previous check (markers removed), so that the
  lesson can continue with it; its first comment line says so (after a cell magic such as `%%distributed`);
- relative links that climb out of `notebooks/` (`../assets/...`) and links to other lessons gain a level;
- lessons without a your-turn cell are copied too (cleared), so the learner's folder is complete.
`--check` writes nothing and exits 1, listing the copies that are stale or missing.
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("your turn")'
SOLUTION_NOTE = "# run this to continue with the reference solution"
ROOT = Path(__file__).resolve().parents[2]
LESSONS = ROOT / "notebooks"
_LESSON_LINK = re.compile(r"(\]\(|href=[\"'])(\d\d_[\w-]+\.ipynb)")


class ExerciseError(ValueError):
    """A lesson's solution markers are malformed (the message names the notebook and the cell)."""


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def split_regions(source: str, where: str = "cell") -> tuple[str, str]:
    """(stubbed source, solution source without markers) of one your-turn cell's source."""
    stub, solution, inside = [], [], None
    for n, line in enumerate(source.splitlines(keepends=True), 1):
        mark = line.strip()
        if mark.startswith(BEGIN):
            if inside is not None:
                raise ExerciseError(f"{where}: line {n}: {BEGIN} inside a region opened on line {inside}")
            inside = n
            indent = line[: len(line) - len(line.lstrip())]
            stub.append(f"{indent}{STUB}\n")
        elif mark.startswith(END):
            if inside is None:
                raise ExerciseError(f"{where}: line {n}: {END} without a {BEGIN}")
            inside = None
        else:
            solution.append(line)
            if inside is None:
                stub.append(line)
    if inside is not None:
        raise ExerciseError(f"{where}: the region opened on line {inside} is never closed ({END})")
    return "".join(stub), "".join(solution)


def _has_marker(source: str) -> bool:
    return any(line.strip().startswith((BEGIN, END)) for line in source.splitlines())


def relink(text: str) -> str:
    """Rewrite relative links of a lesson for a copy one folder deeper (notebooks/exercises/)."""
    text = text.replace("../assets/", "../../assets/")
    return _LESSON_LINK.sub(lambda m: f"{m.group(1)}../{m.group(2)}", text)


def _solution_cell(source: str, cell_id: str):
    lines = source.splitlines(keepends=True)
    head = 1 if lines and lines[0].startswith("%%") else 0  # a cell magic must stay the first line
    body = "".join(lines[:head] + [SOLUTION_NOTE + "\n"] + lines[head:]).rstrip("\n")
    cell = nbformat.v4.new_code_cell(body, metadata={"tags": ["solution"], "jupyter": {"source_hidden": True}})
    cell.id = cell_id[:64]
    return cell


def make_exercise(nb: nbformat.NotebookNode, name: str = "notebook") -> nbformat.NotebookNode:
    """The learner copy of lesson `nb` (a new notebook; `nb` is not modified)."""
    out = copy.deepcopy(nb)
    cells, pending = [], []
    for i, cell in enumerate(out.cells):
        where = f"{name} cell {i} (id {cell.get('id', '?')})"
        if cell.cell_type != "code":
            if _has_marker(cell.source):
                raise ExerciseError(f"{where}: solution markers in a {cell.cell_type} cell")
            cell.source = relink(cell.source)
            cells.append(cell)
            continue
        cell.outputs, cell.execution_count = [], None
        tags = _tags(cell)
        if "your-turn" in tags:
            stub, solution = split_regions(relink(cell.source), where)
            if stub == relink(cell.source):
                raise ExerciseError(f"{where}: a your-turn cell without a {BEGIN} region")
            cell.source = stub
            pending.append(_solution_cell(solution, f"{cell.get('id', i)}-solution"))
        elif _has_marker(cell.source):
            raise ExerciseError(f"{where}: solution markers in a cell not tagged your-turn")
        else:
            cell.source = relink(cell.source)
        cells.append(cell)
        if "check" in tags:
            cells.extend(pending)
            pending = []
    if pending:
        raise ExerciseError(f"{name}: a your-turn cell has no check cell after it")
    out.cells = cells
    return out


def lesson_paths(numbers: list[str] | None = None, lessons: Path = LESSONS) -> list[Path]:
    """The lessons `NN_*.ipynb` (all of them when `numbers` is empty)."""
    paths = sorted(lessons.glob("[0-9][0-9]_*.ipynb"))
    if numbers:
        wanted = {n.zfill(2) for n in numbers}
        paths = [p for p in paths if p.name[:2] in wanted]
        missing = wanted - {p.name[:2] for p in paths}
        if missing:
            raise SystemExit(f"no lesson numbered {', '.join(sorted(missing))} in {lessons}")
    return paths


def render(lesson: Path) -> str:
    """The learner copy of `lesson`, as the text written to disk."""
    nb = nbformat.read(lesson, as_version=4)
    return nbformat.writes(make_exercise(nb, lesson.name)) + "\n"


def generate(numbers: list[str] | None = None, lessons: Path = LESSONS, check: bool = False) -> list[Path]:
    """Write (or with `check`, compare) the learner copies; return the copies that were stale or missing."""
    target = lessons / "exercises"
    stale = []
    paths = lesson_paths(numbers, lessons)
    for lesson in paths:
        dest = target / lesson.name
        text = render(lesson)
        if not dest.exists() or dest.read_text() != text:
            stale.append(dest)
            if not check:
                target.mkdir(exist_ok=True)
                dest.write_text(text)
    if not numbers and target.exists():  # a copy whose lesson is gone is stale too
        names = {p.name for p in paths}
        for orphan in sorted(target.glob("*.ipynb")):
            if orphan.name not in names:
                stale.append(orphan)
                if not check:
                    orphan.unlink()
    return stale


def solved_sources(exercise: nbformat.NotebookNode) -> list[str]:
    """The code a learner runs who takes every solution: stubs dropped, solution cells without their note."""
    out = []
    for cell in exercise.cells:
        if cell.cell_type != "code" or "your-turn" in _tags(cell):
            continue
        src = cell.source
        if "solution" in _tags(cell):
            src = src.replace(SOLUTION_NOTE + "\n", "", 1)
        out.append(src)
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: generate the learner copies, or check that they are up to date."""
    ap = argparse.ArgumentParser(prog="python -m ddp_lib.course.exercises", description=__doc__.split("\n")[0])
    ap.add_argument("numbers", nargs="*", help="lesson numbers (default: all)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when a copy is stale")
    args = ap.parse_args(argv)
    try:
        stale = generate(args.numbers, check=args.check)
    except ExerciseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rel = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in stale]
    if args.check:
        for p in rel:
            print(f"stale: {p}  (run: python -m ddp_lib.course.exercises)")
        return 1 if stale else 0
    print(f"wrote {len(rel)} learner cop{'y' if len(rel) == 1 else 'ies'}" + (": " + ", ".join(rel) if rel else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
