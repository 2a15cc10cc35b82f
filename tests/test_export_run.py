"""The exported script, run for real: torchrun on one node (2 ranks) and two "nodes" of 1 rank over c10d, each ending
on the notebook's ranks' losses to the last bit (gloo, CPU)."""

from __future__ import annotations

import os

import pytest

from ddp_lib.course.tutorial import execute
from ddp_lib.launch import free_port
from ddp_lib.notebook.export import main as export_main
from tests._cluster_run import STEPS, notebook_losses, run_clean, script_env, torchrun, write_notebook, losses


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
    d, nb_losses = exported
    port = free_port()
    node = torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}", "train.py")
    results = run_clean([node, node], d, script_env())
    assert all(rc == 0 for rc, _ in results), results
    got = {}
    for _, out in results:
        got.update(losses(out))
    assert got == nb_losses
