"""`make gpu-check` on a CPU: it stops at once without a GPU; its lesson plumbing and report work on fake inputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from ddp_lib.course import gpu_check as gc

ROOT = Path(__file__).resolve().parents[1]
INFO = dict(gpus=[dict(index=0, name="NVIDIA H100 80GB HBM3", memory_gib=79.1),
                  dict(index=1, name="NVIDIA H100 80GB HBM3", memory_gib=79.1)],
            driver="550.54.15", cuda="12.8", torch="2.13.0", nccl="2.27.3", topology="GPU0\tX\tNV18\nGPU1\tNV18\tX\n")


def test_without_a_gpu_it_stops_at_once_with_a_clear_message(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU visible, even on a GPU machine
    r = subprocess.run([sys.executable, "-m", "ddp_lib.course.gpu_check", "--out", str(tmp_path / "report")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "gpu-check needs a CUDA GPU" in r.stderr and "On a cloud GPU box" in r.stderr
    assert not (tmp_path / "report").exists()  # nothing was run, nothing written


def test_make_gpu_check_fails_without_a_gpu():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MAKEFLAGS="")
    r = subprocess.run(["make", "-s", "-o", "setup", "gpu-check", f"BIN={Path(sys.executable).parent}"],  # no setup here
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "gpu-check needs a CUDA GPU" in r.stderr


def test_lessons_get_k_ranks_and_a_probe_before_each_shutdown():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%load_ext ddp_lib.notebook\n%dist_init -n 2"),
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("%dist_shutdown"),
        nbformat.v4.new_code_cell('get_ipython().run_line_magic("dist_init", "-n 4")'),  # lesson 01's 4-rank part
        nbformat.v4.new_code_cell("%dist_shutdown"),
    ])
    assert gc.prepare_lesson(nb, 8) == 2
    src = [c.source for c in nb.cells]
    assert src[0].endswith("%dist_init -n 8") and "-n 4" in src[4]
    assert src[2].startswith("%%distributed") and gc.PROBE_MARK in src[2] and src[3] == "%dist_shutdown"


def test_a_lesson_runs_on_ranks_and_its_probes_are_read(tmp_path):
    # a two-cell "lesson" through the real magics on 2 gloo ranks: the probe runs and is parsed
    lesson = tmp_path / "99_probe.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[  # --cpu: gloo ranks on a GPU box too, as asserted below
        nbformat.v4.new_code_cell("%load_ext ddp_lib.notebook\n%dist_init -n 2 --cpu"),
        nbformat.v4.new_code_cell("y = rank + 1"),
        nbformat.v4.new_code_cell("%dist_shutdown")]), lesson)
    step = gc.run_lesson(lesson, tmp_path / "out", ranks=2, timeout_s=180)
    assert step.ok, step.detail
    assert step.extra["devices"] == ["cpu"] and step.extra["peak_allocated_mb"] is None  # CPU ranks: no CUDA peak
    executed = nbformat.read(tmp_path / "out" / lesson.name, as_version=4)
    assert sorted(p["rank"] for p in gc.read_probes(executed)) == [0, 1]


def test_a_failing_lesson_is_reported_not_fatal(tmp_path):
    lesson = tmp_path / "98_fails.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("raise ValueError('lesson broke')")]), lesson)
    step = gc.run_lesson(lesson, tmp_path / "out", ranks=2, timeout_s=120)
    assert not step.ok and "lesson broke" in (tmp_path / "out" / lesson.name).read_text()


def test_report_from_fake_inputs(tmp_path):
    out = tmp_path / "gpu-report"
    (out / "bench").mkdir(parents=True)
    (out / "bench" / "ddp.png").write_bytes(b"png")
    steps = [gc.Step("gpu tests (pytest -m gpu)", True, 61.2, str(out / "logs" / "gpu_tests.log")),
             gc.Step("bench ddp (nccl)", False, 12.0, str(out / "logs" / "bench_ddp.log"), "exit status 1")]
    lessons = [gc.Step("05_overlap_and_buckets", True, 95.4, str(out / "notebooks" / "05_overlap_and_buckets.ipynb"),
                       extra=dict(ranks=2, devices=["cuda:0", "cuda:1"], peak_allocated_mb=23456.4, peak_reserved_mb=30001.0))]
    md = gc.write_report(out, INFO, steps, lessons, [str(out / "bench" / "ddp.png")]).read_text()
    assert md.startswith("# GPU check: FAILED")  # one step failed
    assert "NVIDIA H100 80GB HBM3" in md and "driver 550.54.15" in md and "NCCL 2.27.3" in md
    assert "| bench ddp (nccl) | FAILED exit status 1 |" in md
    assert "[05_overlap_and_buckets.ipynb](notebooks/05_overlap_and_buckets.ipynb)" in md
    assert "| 23,456 | 30,001 |" in md and "cuda:0, cuda:1" in md
    assert "![ddp.png](bench/ddp.png)" in md and "NV18" in md
    assert (out / "summary.json").exists()


def test_report_passes_when_everything_passed(tmp_path):
    md = gc.write_report(tmp_path, INFO, [gc.Step("gpu tests (pytest -m gpu)", True, 1.0)], [], []).read_text()
    assert md.startswith("# GPU check: PASSED")


@pytest.mark.parametrize("ok", [True, False])
def test_run_logged_keeps_the_output_and_the_verdict(tmp_path, ok):
    step = gc.run_logged("x", [sys.executable, "-c", f"print('hello'); raise SystemExit({0 if ok else 3})"],
                         tmp_path / "x.log")
    assert step.ok is ok and "hello" in (tmp_path / "x.log").read_text()
    assert step.detail == ("" if ok else "exit status 3")


def test_it_runs_the_whole_cpu_suite_all_gpu_tests_and_the_demo(tmp_path, monkeypatch):
    """gpu-check ran only tests/test_gpu.py; a GPU box must also pass the CPU suite (gloo ranks)."""
    import ddp_lib.course.tutorial

    ran = []
    monkeypatch.setattr(gc, "require_gpus", lambda: 2)
    monkeypatch.setattr(gc, "device_info", lambda: INFO)
    monkeypatch.setattr(ddp_lib.course.tutorial, "lesson_paths", lambda which=None: [])
    monkeypatch.setattr(gc, "run_logged", lambda name, cmd, log, timeout_s=3600: ran.append(cmd) or gc.Step(name, True, 0.0))
    assert gc.main(["--out", str(tmp_path / "r"), "--skip-bench"]) == 0
    pytest_runs = [c[c.index("pytest") + 1:] for c in ran if "pytest" in c]
    cpu = next(c for c in pytest_runs if "not gpu" in c)
    gpu = next(c for c in pytest_runs if c[c.index("-m") + 1] == "gpu")
    assert cpu[-1] == "tests" and gpu[-1] == "tests"  # every test file, not only test_gpu.py
    assert any(c[-2:] == ["-m", "ddp_lib.course.demo"] for c in ran)
    assert "## GPU-path defects: what this run exercised" in (tmp_path / "r" / "README.md").read_text()


def test_the_issue_19_table_counts_the_tests_of_each_item(tmp_path):
    from ddp_lib.course.gpu_items import item_rows, read_junit

    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="tests.test_mesh" name="test_get_on_a_2x2_mesh_answers_per_dimension"/>'
                   '<testcase classname="tests.test_torch_floor" name="test_package_code_uses_no_name_newer_than_the_floor">'
                   '<failure message="x"/></testcase>'
                   '<testcase classname="tests.test_gpu_simulated" name="test_demo_runs_on_gloo[8gpus]"><skipped/></testcase>'
                   '</testsuite></testsuites>')
    results = read_junit(xml)
    assert results["tests/test_mesh.py::test_get_on_a_2x2_mesh_answers_per_dimension"] == "passed"
    rows = {r.split(" | ")[0].strip("| "): r for r in item_rows(results, {"demo (gloo ranks on a GPU box)": True,
                                                                          "00_ranks_and_magics": False})[2:]}
    assert "| 0 / 0 / 1 |" in rows["1"] and "demo (gloo ranks on a GPU box): ok" in rows["1"]
    assert "| 0 / 1 / 0 |" in rows["3"]
    assert "| 1 / 0 / 0 |" in rows["8"] and "00_ranks_and_magics: FAILED" in rows["8"]
    assert "no test ran" in rows["9"]


def test_the_first_hour_table_says_what_ran_for_real_and_what_only_by_construction():
    from ddp_lib.course.gpu_items import FIRST_HOUR, first_hour_rows

    results = {"tests/test_comm_ring.py::test_ring_matches_all_reduce_nccl": "passed",
               "tests/test_comm_ring.py::test_ring_matches_all_reduce_gloo[2]": "passed",
               "tests/test_gpu.py::test_benchmarks_on_nccl_one_variant_alive_at_a_time": "skipped",
               "tests/test_gpu.py::test_profiler_kernel_table_on_one_gpu": "failed",
               "tests/test_notebook_magics.py::test_3e_a_collective_left_pending": "passed"}
    rows = dict(zip([i.title for i in FIRST_HOUR], first_hour_rows(results)[2:]))
    ring, health, device, memory, floor = (rows[i.title] for i in FIRST_HOUR[:5])
    assert "ran for real (1 gpu test(s) passed)" in ring and "| 1 / 0 / 0 |" in ring  # the nccl test is not a CPU one
    assert "by construction only (no GPU test can run it)" in health and "| 1 / 0 / 0 |" in health
    assert "FAILED for real" in device
    assert "its gpu tests were skipped" in memory
    assert "no test ran" in floor
