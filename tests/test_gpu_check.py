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


def test_lessons_get_k_ranks_the_probe_after_each_init_and_a_reading_after_every_rank_cell():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# lesson"),
        nbformat.v4.new_code_cell("%load_ext ddp_lib.notebook\n%dist_init -n 2"),
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_code_cell("%dist_shutdown"),
        nbformat.v4.new_code_cell('get_ipython().run_line_magic("dist_init", "-n 4")'),  # lesson 01's 4-rank part
        nbformat.v4.new_code_cell("%%rank [0]\ny = 2"),
        nbformat.v4.new_code_cell("%dist_shutdown"),
        nbformat.v4.new_code_cell("print('kernel only')"),
    ])
    assert gc.prepare_lesson(nb, 8) == 2  # after cells 2 and 5, the cells that ran on the ranks
    src = [c.source for c in nb.cells]
    assert src[1].endswith("%dist_init -n 8") and "install()" in src[2]
    assert src[3] == "x = 1" and "cell_peak(2, rank, device)" in src[4] and src[5] == "%dist_shutdown"
    assert "-n 4" in src[6] and "install()" in src[7] and "cell_peak(5, rank, device)" in src[9]
    assert src[10] == "%dist_shutdown" and src[11] == "print('kernel only')"


class FakeAllocator:
    """torch.cuda's peak counters, driven by hand: `use(mb)` allocates that much for a moment."""

    def __init__(self) -> None:
        self.peak = 0

    def use(self, mb: int) -> None:
        self.peak = max(self.peak, mb * 2**20)

    def reset(self, device=None) -> None:
        self.peak = 0

    def read(self, device=None) -> int:
        return self.peak


def test_peaks_per_cell_survive_the_lessons_own_resets(monkeypatch):
    import json

    import torch

    from ddp_lib.course import gpu_probe

    alloc = FakeAllocator()
    for module in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(module, "reset_peak_memory_stats", alloc.reset)
        monkeypatch.setattr(module, "max_memory_allocated", alloc.read)
        monkeypatch.setattr(module, "max_memory_reserved", alloc.read)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_probe, "_STATE", None)
    gpu_probe.install()
    gpu = torch.device("cuda", 0)

    def probe(cell: int) -> float:
        line = gpu_probe.cell_peak(cell, 0, gpu)
        return json.loads(line.split(" ", 1)[1])["peak_allocated_mb"]

    alloc.use(900)                       # cell 3: a big model, then the lesson resets before its measurement
    torch.cuda.reset_peak_memory_stats(gpu)
    alloc.use(100)
    assert torch.cuda.max_memory_allocated(gpu) == 100 * 2**20  # what the lesson reads: since its own reset
    assert probe(3) == 900               # a single reading at the end would have said 100
    alloc.use(50)                        # cell 4: small, and the lesson still sees its 100 since its reset
    assert torch.cuda.max_memory_allocated(gpu) == 100 * 2**20
    assert probe(4) == 50
    alloc.use(30)                        # cell 5: 30, then the lesson resets; its view starts afresh
    torch.cuda.reset_peak_memory_stats(gpu)
    assert torch.cuda.max_memory_allocated(gpu) == 0
    assert probe(5) == 30  # the stretch of cell 5 before its reset
    assert gpu_probe.cell_peak(6, 1, torch.device("cpu")).endswith('"peak_allocated_mb": null, "peak_reserved_mb": null}')


def gpu_run(tmp_path, monkeypatch, gpus: int, lesson_devices: list[str], bench: bool = False,
            cpu_build: bool = True, argv: tuple[str, ...] = ()) -> tuple[int, str, list]:
    """main() on a box of `gpus` H100s (nothing run: the steps and lessons are recorded in order); `cpu_build`: whether
    its torch is the CPU build, which the dry plan's simulation needs."""
    import ddp_lib.course.tutorial

    info = dict(INFO, gpus=INFO["gpus"][:gpus])
    order = []
    monkeypatch.setattr(gc, "require_gpus", lambda: gpus)
    monkeypatch.setattr(gc, "device_info", lambda: info)
    monkeypatch.setattr(gc, "_cpu_build", lambda: cpu_build)
    monkeypatch.setattr(ddp_lib.course.tutorial, "lesson_paths", lambda which=None: [Path("02_simple_ddp.ipynb")])
    monkeypatch.setattr(gc, "run_logged", lambda name, cmd, log, timeout_s=3600, env=None: order.append(name) or gc.Step(name, True, 0.0))
    monkeypatch.setattr(gc, "run_lesson", lambda path, out, ranks, timeout_s=1800: order.append(f"lesson -n {ranks}") or gc.Step(
        f"{path.stem} (-n {ranks})", True, 1.0, None, extra=dict(ranks=ranks, devices=lesson_devices)))
    rc = gc.main(["--out", str(tmp_path / "r")] + ([] if bench else ["--skip-bench"]) + list(argv))
    return rc, (tmp_path / "r" / "README.md").read_text(), order


def test_a_one_gpu_box_reports_what_it_could_not_test_not_passed(tmp_path, monkeypatch):
    rc, md, order = gpu_run(tmp_path, monkeypatch, 1, ["cpu"])
    assert rc == 3 and md.startswith("# GPU check: INCOMPLETE") and "PASSED" not in md
    assert "NCCL needs one per rank" in md and "lesson 02_simple_ddp (-n 2): its ranks ran on the CPU only" in md
    # the dry plan first (issue 59: the real peaks are compared with it), then the learner's path, before the suites
    assert order[0].startswith("dry memory plan (simulated 1xH100") and order[1] == "lesson -n 2"


def test_a_cuda_build_skips_the_dry_plan_with_the_reason_unless_given_a_cpu_build(tmp_path, monkeypatch, capsys):
    # a real GPU box has torch's CUDA build, on which ddp_lib.gpusim refuses to run: no failed step, a reason
    rc, md, order = gpu_run(tmp_path, monkeypatch, 1, ["cpu"], cpu_build=False)
    assert not any(o.startswith("dry memory plan") for o in order) and order[0] == "lesson -n 2"
    assert "needs torch's CPU build" in capsys.readouterr().out
    rc, md, order = gpu_run(tmp_path, monkeypatch, 1, ["cpu"], cpu_build=False, argv=("--dry-python", "/cpu/python"))
    assert order[0].startswith("dry memory plan (simulated 1xH100")


def test_a_one_gpu_box_does_not_report_a_busbw_of_0(tmp_path, monkeypatch):
    from ddp_lib.bench.allreduce import format_allreduce

    rc, md, order = gpu_run(tmp_path, monkeypatch, 1, ["cpu"], bench=True)
    assert "bench allreduce (nccl)" not in order and "bench ddp (nccl)" in order
    assert "busbw is not defined for 1 rank" in md
    row = dict(backend="nccl", world_size=1, size_bytes=2**20, iters=5, time_us=10.0, p25_time_us=9.0,
               p75_time_us=11.0, min_time_us=8.0, max_time_us=12.0, algbw_GBps=100.0, busbw_GBps=0.0)
    table = format_allreduce([row])
    assert table.splitlines()[1].endswith(" n/a, 1 rank")  # not a busbw of 0.000


def test_on_two_gpus_the_learners_path_runs_first_and_can_pass(tmp_path, monkeypatch):
    rc, md, order = gpu_run(tmp_path, monkeypatch, 2, ["cuda:0", "cuda:1"])
    assert rc == 0 and md.startswith("# GPU check: PASSED") and "Not tested" not in md
    assert order[1] == "lesson -n 2" and order.count("lesson -n 2") == 1


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
    monkeypatch.setattr(gc, "run_logged", lambda name, cmd, log, timeout_s=3600, env=None: ran.append(cmd) or gc.Step(name, True, 0.0))
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
