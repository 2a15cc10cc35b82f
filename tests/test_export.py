"""ddp_lib.notebook.export: each rule of the export and each bad input, without ranks (fast)."""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import nbformat
import pytest

from ddp_lib.notebook._export_prologue import expand_nodelist, launcher_env
from ddp_lib.notebook.export import Cell, ExportError, classify, export_script, main, notebook_cells

INIT = Cell("%load_ext ddp_lib.notebook\n%dist_init -n 2 --cpu", 1)


def body(script: str) -> str:
    """What follows the prologue: the cells' part of the script."""
    return script.split("    print(*objs)\n", 1)[1]


@pytest.mark.parametrize("spec, hosts", [
    ("node1", ["node1"]),
    ("vm", ["vm"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
    ("a[1-2],login,b[5]", ["a1", "a2", "login", "b5"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("n[1-2].ib", ["n1.ib", "n2.ib"]),
])
def test_nodelist_expands_as_scontrol_does(spec, hosts):
    assert expand_nodelist(spec) == hosts


@pytest.mark.parametrize("spec, why", [
    ("", "empty"), ("n[1-3", "without ']'"), ("n1-3]", "without '['"), ("n[3-1]", "backwards"),
    ("n[a-b]", "not a number"), ("a,,b", "empty host"), ("n[[1]]", "nested"),
])
def test_nodelist_rejects_bad_lists(spec, why):
    with pytest.raises(ValueError, match=re.escape(why if why != "empty host" else "empty host name")):
        expand_nodelist(spec)


def test_launcher_env_torchrun_and_slurm():
    tr = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h0", "MASTER_PORT": "29500"}
    assert launcher_env(tr) == {"launcher": "torchrun", "rank": 3, "local_rank": 1, "world_size": 4,
                                "master_addr": "h0", "master_port": "29500"}
    sl = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "gpu[07-10]",
          "SLURM_JOB_ID": "123456"}
    e = launcher_env(sl)
    assert (e["launcher"], e["rank"], e["local_rank"], e["world_size"], e["master_addr"]) == ("srun", 5, 1, 8, "gpu07")
    assert e["master_port"] == str(20000 + 123456 % 10000)
    assert launcher_env(dict(sl, MASTER_ADDR="x"))["master_addr"] == "x"  # the sbatch script's scontrol wins
    assert launcher_env(dict(sl, MASTER_PORT="1234"))["master_port"] == "1234"


@pytest.mark.parametrize("env, missing", [
    ({}, "RANK"),
    ({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT"),
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_ID": "7"}, "SLURM_NTASKS"),
    ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}, "SLURM_NODELIST"),
])
def test_launcher_env_names_the_unset_variable(env, missing):
    with pytest.raises(RuntimeError, match=f"^{missing} is not set"):
        launcher_env(env)


def test_where_each_cell_ran():
    cells = [Cell("import os\nx = 1", 1), INIT, Cell("y = 2", 2), Cell("# only a comment", 3),
             Cell("%%rank [0,2-3]\nprint(y)", 4), Cell("%%rank[1]\nprint(1)", 5), Cell("%dist_mode -d", 6),
             Cell("k = 3", 7), Cell("%%distributed\nz = 4", 8), Cell("%dist_mode -e", 9), Cell("w = 5", 10),
             Cell("%dist_shutdown", 11), Cell("v = 6", 12)]
    where = [(c.label, w) for c, w in classify(cells)]
    assert where == [(1, None), (1, "magic"), (2, "all"), (4, (0, 2, 3)), (5, (1,)), (6, "magic"), (7, None),
                     (8, "all"), (9, "magic"), (10, "all"), (11, "magic"), (12, None)]


def test_script_keeps_rank_cells_in_order_and_leaves_kernel_cells_out():
    cells = [Cell("import matplotlib", 1), INIT, Cell("y = rank + 1", 3),
             Cell("%%rank [0]\ns = '''a\nb'''\nprint(y, s)", 4), Cell("%%rank [0]\nplt_thing = 1", 5),
             Cell("%dist_shutdown", 6)]
    cells[1] = Cell(INIT.source, 2)
    script = export_script(cells, cpu_only=True)
    ast.parse(script)
    b = body(script)
    assert b.index("y = rank + 1") < b.index("if rank in (0,):") < b.index("plt_thing")
    assert "    s = '''a\nb'''\n    print(y, s)" in b  # the string's second line keeps its value
    assert "# [1] left out (ran in the kernel, not on the ranks): import matplotlib" in b
    assert "# [2] left out (magics, run by the kernel)" in b
    assert "CPU_ONLY = True" in script and b.rstrip().endswith("dist.destroy_process_group()")


def test_future_import_moves_to_the_top():
    script = export_script([INIT, Cell('%%distributed\n"""doc"""\nfrom __future__ import annotations\nx: int = 1', 2)])
    tree = ast.parse(script)
    assert isinstance(tree.body[1], ast.ImportFrom) and tree.body[1].module == "__future__"
    assert script.count("from __future__") == 1


def test_a_kernel_variable_read_on_the_ranks_fails_naming_it():
    cells = [Cell("lr = 0.1\nsteps = 3", 1), INIT, Cell("print(steps)", 3)]
    with pytest.raises(ExportError, match=r"cell \[3\] reads 'steps', which only the kernel had \(bound in cell \[1\]"):
        export_script(cells)
    # the same name bound on the ranks first, or in the cell itself, is the ranks' own
    export_script(cells[:2] + [Cell("steps = 5", 3), Cell("print(steps)", 4)])
    export_script(cells[:2] + [Cell("steps = 5\nprint(steps)", 3)])
    # a kernel cell after %dist_mode -d binds kernel names too
    with pytest.raises(ExportError, match="'data'"):
        export_script([INIT, Cell("%dist_mode -d", 2), Cell("data = [1]", 3), Cell("%dist_mode -e", 4),
                       Cell("print(len(data))", 5)])


def test_a_cell_marked_skip_is_left_out_and_its_names_stay_behind():
    # the lesson's cells that read the script and launch it: exported again after them, the script would launch itself
    run = Cell("job = 1  # dist_export: skip", 3)
    b = body(export_script([INIT, Cell("x = 1", 2), run, Cell("%%rank [0]\n# dist_export: skip\nprint(x)", 4)]))
    assert "# [3] left out (marked '# dist_export: skip'): job = 1" in b and "job = 1\n" not in b.split("\n", 1)[1]
    assert "# [4] left out (marked '# dist_export: skip'): # dist_export: skip" in b and "if rank in" not in b
    with pytest.raises(ExportError, match=r"cell \[4\] reads 'job', .* \(bound in cell \[3\], which is left out: mark"):
        export_script([INIT, Cell("x = 1", 2), run, Cell("print(job)", 4)])


def test_lesson_10_exported_again_after_running_its_script_is_the_same_script():
    # a learner who runs the torchrun cell, then the export cell again: the history now holds the cells that read and
    # launch the script; the script must not launch itself (or read runs/lesson10/ from inside it)
    nb = nbformat.read(str(Path(__file__).parents[1] / "notebooks/10_leaving_the_notebook.ipynb"), as_version=4)
    src = {c.id: c.source for c in nb.cells if c.cell_type == "code"}
    order = ["c01", "c03", "c04", "c06", "c07", "c09", "c11", "c06"]
    first, again = (export_script([Cell(src[c], i) for i, c in enumerate(ids, 1)]) for ids in (order[:4], order))
    code = [[ln for ln in s.splitlines() if ln.strip() and not ln.startswith("# [")] for s in (first, again)]
    assert code[0] == code[1]
    assert "torch.distributed.run" not in again and again.count("left out (marked '# dist_export: skip')") == 3


def test_nothing_ran_on_the_ranks_is_an_error_not_an_empty_script():
    # a restarted kernel that ran %dist_init and the export cell only
    with pytest.raises(ExportError, match="no cell of the notebook ran on the ranks"):
        export_script([INIT, Cell("%dist_export runs/train.py", 2)])
    with pytest.raises(ExportError, match="no cell"):
        export_script([INIT, Cell("x = 1  # dist_export: skip", 2)])


@pytest.mark.parametrize("cells, match", [
    ([Cell("%%rank [0]\nx = 1", 1)], "before any %dist_init"),
    ([Cell("%%distributed\nx = 1", 1)], "before any %dist_init"),
    ([INIT, Cell("%%rank [a]\nx = 1", 2)], "not a rank list"),
    ([INIT, Cell("x = 1\n%time y = 2", 2)], r"cell \[2\] ran on the ranks but is not plain Python"),
])
def test_bad_cells_fail_with_the_reason(cells, match):
    with pytest.raises(ExportError, match=match):
        export_script(cells)


def _nb(tmp_path, cells):
    nb = nbformat.v4.new_notebook()
    for src, n in cells:
        c = nbformat.v4.new_code_cell(src)
        c.execution_count = n
        nb.cells.append(c)
    nb.cells.insert(1, nbformat.v4.new_markdown_cell("text"))
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    return path


def test_saved_notebook_is_read_in_execution_order_and_never_changed(tmp_path):
    path = _nb(tmp_path, [(INIT.source, 1), ("b = a + 1", 3), ("a = 1", 2), ("never = 0", None)])
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    assert [c.label for c in notebook_cells(path)] == [1, 2, 3]
    assert [c.label for c in notebook_cells(path, "document")] == [1, 3, 2, None]
    out = tmp_path / "train.py"
    assert main([str(path), "-o", str(out)]) == 0
    b = body(out.read_text())
    assert b.index("a = 1") < b.index("b = a + 1") and "never" not in b
    assert (tmp_path / "train.sbatch").exists() and (tmp_path / "train.torchrun.sh").exists()
    srun = [ln for ln in (tmp_path / "train.sbatch").read_text().splitlines() if ln.startswith("srun ")]
    # srun does not take --cpus-per-task from the allocation since Slurm 22.05: the script hands it on
    assert len(srun) == 1 and '--cpus-per-task="${SLURM_CPUS_PER_TASK:-1}"' in srun[0], srun
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_saved_notebook_bad_inputs(tmp_path, capsys):
    with pytest.raises(ExportError, match="no cell has run"):
        notebook_cells(_nb(tmp_path, [(INIT.source, None), ("a = 1", None)]))
    with pytest.raises(ExportError, match=r"execution counts \[2\] appear twice"):
        notebook_cells(_nb(tmp_path, [(INIT.source, 1), ("a = 1", 2), ("b = 1", 2)]))
    assert main([str(_nb(tmp_path, [("k = 1", 1), (INIT.source, 2), ("print(k)", 3)])), "-o",
                 str(tmp_path / "t.py")]) == 2
    assert "reads 'k'" in capsys.readouterr().err and not (tmp_path / "t.py").exists()


@pytest.mark.parametrize("lesson", sorted(p.name for p in (Path(__file__).parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb")))
def test_every_lesson_exports_to_a_script_that_parses(lesson):
    """Each lesson's rank cells (mirror cells with their __future__ import, %%rank plots, ...) make valid Python."""
    path = Path(__file__).parents[1] / "notebooks" / lesson
    try:
        cells = notebook_cells(path)
    except ExportError:  # a lesson committed without outputs: its cells as they stand
        cells = notebook_cells(path, "document")
    script = export_script(cells, lesson)
    tree = ast.parse(script)
    assert "if rank in (0,):" in script or lesson.startswith("10_")
    assert isinstance(tree.body[-1], ast.Expr) and "destroy_process_group" in ast.unparse(tree.body[-1])


def test_dist_export_sees_cells_run_without_history(tmp_path, monkeypatch):
    # nbval runs every cell with store_history=False: the kernel's history stays empty, and %dist_export exported no
    # cell at all (lesson 10 failed under nbval); the extension's own record of what ran must be used then
    from IPython.core.interactiveshell import InteractiveShell

    from ddp_lib.notebook.magics import DistributedMagics

    shell = InteractiveShell.instance()
    magics = DistributedMagics(shell)
    try:
        start = len(magics._ran)
        shell.run_cell("a_kernel_value = 1", store_history=False)
        shell.run_cell("%%rank [0]\nprint('rank 0 only')", store_history=False)
        cells = magics._export_cells()
        assert [c.source for c in cells][start:] == ["a_kernel_value = 1", "%%rank [0]\nprint('rank 0 only')"]
        assert [c.source for c in cells] == magics._ran  # numbered in the order they ran
        shell.run_cell("stored = 2", store_history=True)
        assert magics._export_cells()  # either source, never empty once cells ran
    finally:
        shell.events.unregister("pre_run_cell", magics._note_cell)
        InteractiveShell.clear_instance()
