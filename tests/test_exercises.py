"""The learner copies: regions become stubs, solutions follow the checks, copies never go stale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from ddp_lib.course import exercises as E

ROOT = Path(__file__).resolve().parent.parent


def code(src: str, *tags: str, cell_id: str | None = None):
    c = nbformat.v4.new_code_cell(src, metadata={"tags": list(tags)} if tags else {})
    c.outputs = [nbformat.v4.new_output("stream", text="old output\n")]
    c.execution_count = 3
    if cell_id:
        c.id = cell_id
    return c


def synthetic() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("![overview](../assets/ddp_overview.png), see [lesson 1](01_collectives.ipynb#Timing)"),
        code("def sync(model):\n    \"\"\"Average grads.\"\"\"\n    # hint: all_reduce then divide\n"
             "    for p in model.parameters():\n        ### BEGIN SOLUTION\n        dist.all_reduce(p.grad)\n"
             "        p.grad /= 2\n        ### END SOLUTION\n    return None\n", "your-turn", cell_id="yt1"),
        code("check_sync(sync);", "check"),
        code("%%distributed\nclass A:\n    def f(self):\n        ### BEGIN SOLUTION\n        return 1\n"
             "        ### END SOLUTION\n\n    def g(self):\n        ### BEGIN SOLUTION\n        return 2\n"
             "        ### END SOLUTION\n", "your-turn", cell_id="yt2"),
        code("print('between')"),
        code("check_engine(A);", "check"),
        code("%%distributed\nprint(open('../assets/x.json').read())", "mirror:ddp_lib/x.py"),
    ]
    return nb


def test_regions_become_stubs_at_the_begin_indentation():
    ex = E.make_exercise(synthetic())
    first = ex.cells[1].source
    assert '        raise NotImplementedError("your turn")\n' in first
    assert "dist.all_reduce" not in first and "BEGIN" not in first
    assert first.startswith('def sync(model):\n    """Average grads."""\n    # hint:')  # signature, docstring, hint kept
    assert first.endswith("    return None\n")
    two = ex.cells[4].source
    assert two.count('raise NotImplementedError("your turn")') == 2 and "return 1" not in two


def test_outputs_cleared_and_solutions_after_each_check():
    ex = E.make_exercise(synthetic())
    kinds = [(c.cell_type, c.metadata.get("tags", [])) for c in ex.cells]
    assert [k[1] for k in kinds] == [[], ["your-turn"], ["check"], ["solution"], ["your-turn"], [], ["check"],
                                     ["solution"], ["mirror:ddp_lib/x.py"]]
    for c in ex.cells:
        if c.cell_type == "code":
            assert c.outputs == [] and c.execution_count is None
    sol1, sol2 = ex.cells[3], ex.cells[7]
    assert sol1.metadata.jupyter.source_hidden is True and sol1.id == "yt1-solution"
    assert sol1.source.splitlines()[0] == E.SOLUTION_NOTE
    assert "dist.all_reduce(p.grad)\n        p.grad /= 2" in sol1.source and "SOLUTION\n" not in sol1.source
    # a cell magic stays the first line; the note comes after it
    assert sol2.source.splitlines()[:2] == ["%%distributed", E.SOLUTION_NOTE]
    assert "return 1" in sol2.source and "return 2" in sol2.source


def test_links_rewritten_for_the_deeper_folder_and_lesson_untouched():
    nb = synthetic()
    before = nbformat.writes(nb)
    ex = E.make_exercise(nb)
    assert nbformat.writes(nb) == before  # the lesson itself is not modified
    assert "](../../assets/ddp_overview.png)" in ex.cells[0].source
    assert "](../01_collectives.ipynb#Timing)" in ex.cells[0].source
    assert "../../assets/x.json" in ex.cells[-1].source


@pytest.mark.parametrize("cells, message", [
    ([code("x = 1\n### BEGIN SOLUTION\ny = 2\n", "your-turn"), code("c", "check")], "never closed"),
    ([code("### END SOLUTION\n", "your-turn"), code("c", "check")], "without a"),
    ([code("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "your-turn")], "inside a region"),
    ([nbformat.v4.new_markdown_cell("### BEGIN SOLUTION\nx\n### END SOLUTION")], "markdown cell"),
    ([code("### BEGIN SOLUTION\nx\n### END SOLUTION\n")], "not tagged your-turn"),
    ([code("x = 1\n", "your-turn"), code("c", "check")], "without a ### BEGIN"),
    ([code("### BEGIN SOLUTION\nx\n### END SOLUTION\n", "your-turn")], "no check cell"),
])
def test_bad_input_is_a_clear_error(cells, message):
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    with pytest.raises(E.ExerciseError, match=message):
        E.make_exercise(nb, "bad.ipynb")


def test_solution_cells_give_back_the_lessons_code():
    nb = synthetic()
    ex = E.make_exercise(nb)
    lesson_order = []  # the lesson's code, each your-turn cell moved after the check that follows it
    pending = []
    for c in nb.cells:
        if c.cell_type != "code":
            continue
        if "your-turn" in c.metadata.get("tags", []):
            pending.append(E.split_regions(c.source)[1].rstrip("\n"))
            continue
        lesson_order.append(E.relink(c.source))
        if "check" in c.metadata.get("tags", []):
            lesson_order += pending
            pending = []
    assert E.solved_sources(ex) == lesson_order


def test_generate_and_check_on_a_folder(tmp_path):
    nbformat.write(synthetic(), tmp_path / "02_demo.ipynb")
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "03_plain.ipynb")
    assert len(E.generate(lessons=tmp_path, check=True)) == 2  # missing copies are stale
    E.generate(lessons=tmp_path)
    assert sorted(p.name for p in (tmp_path / "exercises").iterdir()) == ["02_demo.ipynb", "03_plain.ipynb"]
    assert E.generate(lessons=tmp_path, check=True) == []
    (tmp_path / "exercises" / "02_demo.ipynb").write_text("{}")
    assert [p.name for p in E.generate(lessons=tmp_path, check=True)] == ["02_demo.ipynb"]


def _lesson_pairs():
    return [(p, ROOT / "notebooks" / "exercises" / p.name) for p in E.lesson_paths()]


def test_committed_learner_copies_are_fresh():
    if not (ROOT / "notebooks" / "exercises").exists():
        pytest.skip("notebooks/exercises/ is not committed yet (the lead generates it: python -m ddp_lib.course.exercises)")
    r = subprocess.run([sys.executable, "-m", "ddp_lib.course.exercises", "--check"], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_lesson_makes_a_learner_copy_whose_solutions_are_the_lesson():
    for lesson, _ in _lesson_pairs():
        nb = nbformat.read(lesson, as_version=4)
        ex = E.make_exercise(nb, lesson.name)
        solved = E.solved_sources(ex)
        want = [E.relink(E.split_regions(c.source)[1].rstrip("\n") if "your-turn" in c.metadata.get("tags", [])
                         else c.source) for c in nb.cells if c.cell_type == "code"]
        assert sorted(solved) == sorted(want), lesson.name
