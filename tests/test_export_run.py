"""The exported script, run for real: torchrun on one node (2 ranks), two "nodes" of 1 rank over c10d, and the sbatch
script on a one-host SLURM (2 tasks; then requeued mid-run, resuming from its checkpoint), each ending on the notebook's
ranks' losses to the last bit (gloo, CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from ddp_lib.course.tutorial import execute
from ddp_lib.launch import free_port
from ddp_lib.notebook.export import main as export_main
from tests._cluster_run import LOSS, STEPS, losses, notebook_losses, run_clean, script_env, torchrun, write_notebook
from tests._slurm import slurm  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow  # a kernel, then torch imported by every rank of four launches: minutes on 2 cores


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A training notebook executed by a real kernel with 2 ranks, and the script exported from it."""
    d = tmp_path_factory.mktemp("export-run")
    nb = write_notebook(d / "train_nb.ipynb")
    old = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "DDP_NB_LIVE_AFTER_S")}
    os.environ.update(OMP_NUM_THREADS="1", DDP_NB_LIVE_AFTER_S="inf")  # the kernel and its ranks inherit them
    try:
        execute(nb, timeout=300)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    nb_losses = notebook_losses(nb)
    assert sorted(nb_losses) == [(r, s) for r in range(2) for s in range(STEPS)], nb_losses
    assert export_main([str(nb), "-o", str(d / "train.py")]) == 0
    return d, nb_losses


def test_script_shape(exported):
    d, _ = exported
    text = (d / "train.py").read_text()
    assert "# [1] left out (ran in the kernel, not on the ranks): import matplotlib" in text
    assert "if rank in (0,):\n    print(f\"rank 0 done" in text
    assert text.rstrip().endswith("dist.destroy_process_group()")


def test_torchrun_one_node_matches_the_notebook(exported):
    d, nb_losses = exported
    [(rc, out)] = run_clean([torchrun("--standalone", "--nproc-per-node", "2", "train.py")], d, script_env())
    assert rc == 0, out
    assert losses(out) == nb_losses
    assert "rank 0 done: 8 steps" in out


def test_torchrun_two_nodes_c10d_matches_the_notebook(exported):
    """The launch file's several-node line, run twice on this machine: two "nodes" of 1 rank over c10d (the second
    one's endpoint check meets the first one's store, or finds the port free, and lets it through)."""
    d, nb_losses = exported
    port = free_port()
    env = dict(script_env(), NNODES="2", NPROC="1", RDZV_HOST="127.0.0.1", RDZV_PORT=str(port), JOB_ID=f"t{port}",
               PYTHON=sys.executable, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    node = ["bash", "train.torchrun.sh", "many"]
    results = run_clean([node, node], d, env)
    assert all(rc == 0 for rc, _ in results), results
    got = {}
    for _, out in results:
        got.update(losses(out))
    assert got == nb_losses


def _sbatch(slurm, d, **env) -> tuple[str, str, str]:
    """Submit the exported sbatch script as a learner would (`sbatch train.sbatch`); (job id, final state, its log)."""
    job_env = dict(script_env(), **slurm.env, **env)
    job_env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), job_env["PATH"]])  # `python` = this venv's
    sub = subprocess.run(["sbatch", "--parsable", "train.sbatch"], cwd=d, env=job_env, capture_output=True, text=True,
                         timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    state = slurm.wait_job(job)
    log = d / f"train-{job}.out"
    return job, state, log.read_text() if log.exists() else f"(no log {log})"


def test_sbatch_two_tasks_matches_the_notebook(exported, slurm):
    d, nb_losses = exported
    job, state, log = _sbatch(slurm, d)
    assert state == "COMPLETED", log
    assert losses(log) == nb_losses, log
    assert f"job {job} restart 0 on {slurm.host}, rank 0 at {slurm.host}:" in log


def test_sbatch_requeued_job_resumes_from_its_checkpoint(exported, slurm):
    d, nb_losses = exported
    job, state, log = _sbatch(slurm, d, STOP_AFTER="4")  # the first run requeues itself after step 4's checkpoint
    assert state == "COMPLETED", log
    assert f"job {job} restart 1 " in log, log  # it ran a second time: SLURM requeued it
    assert "rank 0 resumed after step 4" in log and "rank 1 resumed after step 4" in log, log
    printed = [(int(r), int(s)) for r, s, _ in LOSS.findall(log)]
    assert sorted(printed) == sorted(nb_losses), log  # every step once: steps 0-3 in the first run, 4-7 after resuming
    assert losses(log) == nb_losses, log  # and the resumed steps end on the uninterrupted notebook's losses


def test_dist_export_magic_writes_this_kernels_rank_cells(tmp_path):
    """%dist_export in a live kernel: its history, in the order it ran, and the kernel-only variable refused."""
    from tests._nbkernel import Kernel

    k = Kernel(tmp_path, env={"OMP_NUM_THREADS": "1"})
    try:
        for code in ("lr = 0.1  # in the kernel", "%load_ext ddp_lib.notebook\n%dist_init -n 2 --cpu",
                     "x = torch.ones(2) * (rank + 1)\ndist.all_reduce(x)", "%%rank [1]\nprint('sum', x.tolist())"):
            assert k.run(code, timeout=180).status == "ok", code
        r = k.run("%dist_export job.py")
        assert r.status == "ok" and "wrote job.py, job.torchrun.sh, job.sbatch" in r.stdout, r.text
        text = (tmp_path / "job.py").read_text()
        assert text.index("dist.all_reduce(x)") < text.index("if rank in (1,):\n    print('sum', x.tolist())")
        assert "# [1] left out (ran in the kernel, not on the ranks): lr = 0.1" in text
        assert "# [5] left out (magics, run by the kernel): %dist_export job.py" in text
        assert k.run("y = lr * 2").status == "error"  # a NameError on the ranks; the export names the variable
        r = k.run("%dist_export job2.py")
        assert r.status == "error" and "cell [6] reads 'lr', which only the kernel had (bound in cell [1]" in r.text
        assert not (tmp_path / "job2.py").exists()
        k.run("%dist_shutdown")
    finally:
        k.close()


LESSONS_THAT_TRAIN = ["02", "03", "04", "05", "07", "08"]
_HEADER = re.compile(r"^--- rank (\d+) ---\n", re.M)


def _lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.strip("\n").splitlines()]


def checked_outputs(nb_path: Path) -> list[tuple[int, int | None, list[str]]]:
    """What nbval compares in a lesson (its cells tagged nbval-check-output, the outputs the lesson declares
    deterministic, also under the suite's DDP_NBVAL=1): (cell number, rank, the lines that rank printed); rank None
    where one rank printed without a header (a %%rank cell)."""
    nb = nbformat.read(str(nb_path), as_version=4)
    out = []
    for c in nb.cells:
        if c.cell_type != "code" or "nbval-check-output" not in c.metadata.get("tags", []):
            continue
        text = "".join(o.get("text", "") for o in c.get("outputs", [])
                       if o.get("output_type") == "stream" and o.get("name") == "stdout")
        parts = _HEADER.split(text)
        if parts[0].strip():
            out.append((c.execution_count, None, _lines(parts[0])))
        out.extend((c.execution_count, int(r), _lines(b)) for r, b in zip(parts[1::2], parts[2::2]) if b.strip())
    return out


def _contains(lines: list[str], block: list[str]) -> bool:
    n = len(block)
    return any(lines[i:i + n] == block for i in range(len(lines) - n + 1))


@pytest.mark.skipif(os.environ.get("DDP_EXPORT_LESSONS") != "1",
                    reason="each lesson's script takes about a minute or more under torchrun on 2 cores (its benchmarks "
                           "too): DDP_EXPORT_LESSONS=1 runs them")
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lesson", LESSONS_THAT_TRAIN)
def test_lesson_script_runs_under_torchrun(lesson, tmp_path):
    """A training lesson, as committed (executed), exported and run under torchrun on 2 ranks, in the lesson's folder
    (its relative paths), with the suite's DDP_NBVAL=1 (the lessons' short runs): it exits 0, and each rank prints
    every output the lesson checks (its nbval-check-output cells' text, committed) line for line; timings and
    memory figures are in untagged cells, left out."""
    notebooks = Path(__file__).parents[1] / "notebooks"
    nb = next(notebooks.glob(f"{lesson}_*.ipynb"))
    expected = checked_outputs(nb)
    assert expected, f"{nb.name} has no nbval-check-output cell with printed text to compare"
    assert export_main([str(nb), "-o", str(tmp_path / "train.py"), "--no-launch-files"]) == 0
    logs = tmp_path / "logs"
    [(rc, out)] = run_clean([torchrun("--standalone", "--nproc-per-node", "2", "--log-dir", str(logs), "--tee", "3",
                                      str(tmp_path / "train.py"))], notebooks,
                            dict(script_env(), DDP_NBVAL="1"), timeout_s=800)
    assert rc == 0, out[-6000:]
    printed = {int(f.parent.name): _lines(f.read_text()) for f in logs.glob("*/attempt_0/*/stdout.log")}
    assert sorted(printed) == [0, 1], sorted(logs.rglob("*"))
    missing = [(cell, r, block) for cell, r, block in expected
               if not any(_contains(printed[k], block) for k in ([r] if r is not None else printed))]
    assert not missing, "\n".join(f"cell [{c}] rank {r}: not printed by the script:\n" + "\n".join(b)
                                  for c, r, b in missing[:5])
