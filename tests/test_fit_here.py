"""Lessons 04 and 05 find an α–β fit on any box: lesson 01's when it ran (both of its sessions kept), else one measured
in place, saying so.

The defect (issue 59): on a 2xT4 box lesson 01's `-n 2` session runs NCCL in fresh interpreters started by the
kernel, its `-n 4` session falls back to gloo, whose ranks fork from the kernel's template (the fork server). Lesson
01 keyed its rows file by `os.getppid()`, so the 4-rank session did not find the 2-rank rows, and `save_fits` rewrote
the fit file with the gloo x4 fit alone: lesson 04 then stopped with "no α–β fit for nccl x2". A kernel on a simulated
2xT4 box, whose ranks start as a box starts them, runs lesson 01's own cells here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

from ddp_lib.bench.alphabeta import load_fit, save_fits
from ddp_lib.launch import spawn

sys.path.insert(0, str(Path(__file__).parent))
from _nbkernel import Kernel  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SIZES = [4096 * 4**i for i in range(6)]


def _rows(backend: str, ws: int, alpha_s: float) -> list[dict]:
    return [dict(backend=backend, world_size=ws, size_bytes=n, time_us=(alpha_s + n / 1e9) * 1e6) for n in SIZES]


def test_save_fits_merges_by_backend_and_world_size(tmp_path):
    path = tmp_path / "fit.json"
    save_fits(_rows("nccl", 2, 20e-6), path, machine="box A")
    save_fits(_rows("gloo", 4, 2e-3), path, machine="box A, gloo")  # lesson 01's 4-rank session: nccl x2 stays
    assert load_fit("nccl", 2, [path])[0].alpha_us == pytest.approx(20.0)
    assert load_fit("gloo", 4, [path])[0].alpha_us == pytest.approx(2000.0)
    save_fits(_rows("nccl", 2, 40e-6), path, machine="box B")  # a new measurement replaces the old one
    fits = json.loads(path.read_text())["fits"]
    assert sorted((f["backend"], f["world_size"]) for f in fits) == [("gloo", 4), ("nccl", 2)]
    fit, rec = load_fit("nccl", 2, [path])
    assert fit.alpha_us == pytest.approx(40.0) and rec["machine"] == "box B"
    assert load_fit("gloo", 4, [path])[1]["machine"] == "box A, gloo"  # each fit keeps the machine it ran on


def _fit_twice(path: str) -> list:
    from ddp_lib.bench.fit_here import fit_or_measure

    missing = Path(path).with_name("never-written.json")
    first = fit_or_measure(paths=[missing, path], save_to=path, sizes=SIZES[:4], iters=3)[1]
    second = fit_or_measure(paths=[missing, path], save_to=path)[1]
    return [first["measured_here_s"], first["path"], second["measured_here_s"], second["path"], second["backend"],
            second["world_size"], len(second["rows"])]


def test_a_missing_fit_is_measured_in_place_then_loaded(tmp_path):
    path = tmp_path / "runs" / "fit.json"
    first_s, first_path, second_s, second_path, backend, ws, points = spawn(
        _fit_twice, world_size=2, args=(str(path),), backend="gloo", timeout_s=180, threads=1)[0]
    assert first_s is not None and first_s > 0 and first_path == str(path)  # measured, and says how long it took
    assert second_s is None and second_path == str(path)  # the second call reads what the first saved
    assert (backend, ws, points) == ("gloo", 2, 4)


def _cell(lesson: str, cell_id: str) -> str:
    nb = nbformat.read(next((ROOT / "notebooks").glob(f"{lesson}_*.ipynb")), as_version=4)
    return next(c.source for c in nb.cells if c.get("id") == cell_id)


SESSION = """%%distributed
import json, os
from ddp_lib.bench import save_rows
from ddp_lib.bench.alphabeta import save_fits
rows = [dict(backend=dist.get_backend(), world_size=world_size, size_bytes=n, time_us=(30e-6 * world_size + n / 1e9) * 1e6)
        for n in [4096 * 4**i for i in range(6)]]
earlier = [r for f in sorted(__import__("glob").glob(ROWS_FILE.format("*"))) for r in json.load(open(f))
           if r["world_size"] != world_size]
if rank == 0:
    save_rows(rows, ROWS_FILE.format(world_size))
    save_fits(earlier + rows, FIT)  # as lesson 01's cells c18 (2 ranks) and c29 (both sessions) do
    print("session", world_size, dist.get_backend(), os.getppid(), len(earlier))
"""


@pytest.mark.slow
@pytest.mark.gpusim
@pytest.mark.timeout(900)
def test_lesson01_two_sessions_leave_the_fit_lesson04_reads_on_a_2xT4_box(tmp_path, monkeypatch):
    if not shutil.which(os.environ.get("CXX", "c++")):
        pytest.skip("no C++ compiler: ddp_lib.gpusim compiles its CUDA guard shim once (apt-get install g++)")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fit = tmp_path / "alphabeta_fit.json"
    k = Kernel(tmp_path, env={"DDP_GPU_SIM": "2xT4", "DDP_SMALL": "1", "DDP_NBVAL": "1"})
    try:
        assert k.run("%load_ext ddp_lib.notebook", timeout=300).status == "ok"
        sessions = []
        for n, cell in ((2, "c03"), (4, "c24")):  # lesson 01's parameters cell of each session, as written
            r = k.run(f"%dist_init -n {n}", timeout=400)
            assert r.status == "ok", r.text
            for code in (_cell("01", cell), f"FIT = {str(fit)!r}", SESSION):
                r = k.run(code if code.startswith("%%") else "%%distributed\n" + code, timeout=300)
                assert r.status == "ok", r.text
            sessions.append(next(line.split() for line in r.stdout.splitlines() if line.startswith("session")))
            assert k.run("%dist_shutdown", timeout=120).status == "ok"
    finally:
        k.close()
        for f in Path(tempfile.gettempdir()).glob(f"ddp_lesson01_rows_{k.pid}_*"):
            f.unlink()
    (_, n2, b2, parent2, _), (_, n4, b4, parent4, found) = sessions
    # ranks started as on a box: NCCL ranks are the kernel's children, the gloo fallback's are forks of its template
    assert (n2, b2, n4, b4) == ("2", "nccl", "4", "gloo")
    assert parent2 == str(k.pid) and parent4 != str(k.pid), sessions
    assert found == str(len(SIZES))  # the 4-rank session found the 2-rank session's rows
    assert load_fit("nccl", 2, [fit])[0].alpha_us == pytest.approx(60.0)  # what lesson 04 reads on this box
    assert load_fit("gloo", 4, [fit])[0].alpha_us == pytest.approx(120.0)


def test_the_sum_check_skips_itself_in_a_dry_run_only(monkeypatch):
    """In gpusim's dry mode an all-reduce moves nothing (its values are placeholders): lesson 04's in-place fit
    stopped at the sum check, 'gave values in [0.0, 0.0]'. Anywhere else a wrong sum still raises."""
    import torch

    from ddp_lib import gpusim
    from ddp_lib.bench.allreduce import check_sum

    wrong = torch.zeros(8)
    with pytest.raises(RuntimeError, match="expected 1 everywhere"):
        check_sum(wrong, torch.float32)
    monkeypatch.setattr(gpusim, "dry", lambda: True)
    check_sum(wrong, torch.float32)
