"""`python -m ddp_lib.gpusim.run` (make gpu-sim): the ranks it gives the lessons, its fast mode, its summary.

The lessons are not executed here (`execute` is replaced by a recorder): make gpu-sim runs them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest

from ddp_lib.apps.smollm2 import RANDOM_ENV
from ddp_lib.gpusim import DRY_ENV, ENV, _peaks, run


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    """run.main with `execute` recording the environment each lesson would run under; returns (calls, out dir)."""
    for key in (ENV, DRY_ENV, _peaks.ENV, "DDP_SMALL", "DDP_NBVAL", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(key, "x")  # main sets them for its kernels: restored after the test
    monkeypatch.setenv(RANDOM_ENV, "x")  # recorded as absent before the test, so main's setting is undone after it
    monkeypatch.delenv(RANDOM_ENV)
    monkeypatch.setattr(run, "host_available_gb", lambda: 1000.0)  # a host with room, unless a test says otherwise
    calls = []

    def execute(path, out, timeout, cwd, edit):
        calls.append((path.name, os.environ.get(ENV), os.environ.get("DDP_SMALL"), os.environ.get("DDP_NBVAL")))
        if os.environ.get(DRY_ENV) == "1":  # a dry lesson's processes leave their peaks where run.main said
            folder = Path(os.environ[_peaks.ENV])
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "1.json").write_text(json.dumps(
                {"pid": 1, "gpu_peak_bytes": {"0": 3 * 2**30, "1": 2**30}, "host_max_rss_bytes": 2**29}))
            (folder / "2.json").write_text(json.dumps(
                {"pid": 2, "gpu_peak_bytes": {"0": 2**30}, "host_max_rss_bytes": 2**30}))
    monkeypatch.setattr(run, "execute", execute)
    return calls, tmp_path


def test_fast_mode_adds_the_suites_shrink_on_top_of_small_models(recorded):
    calls, out = recorded
    assert run.main(["--profile", "1xH100", "-n", "1", "--fast", "--out", str(out), "00"]) == 0
    assert calls == [("00_ranks_and_magics.ipynb", "1xH100", "1", "1")]
    assert (out / "summary.txt").read_text().splitlines()[0] == "profile 1xH100, -n 1, DDP_SMALL=1 DDP_NBVAL=1"


def test_without_fast_the_lessons_run_their_full_steps_even_from_the_suites_env(recorded):
    calls, out = recorded
    os.environ["DDP_NBVAL"] = "1"  # as under pytest-env
    assert run.main(["--out", str(out), "00"]) == 0
    assert calls == [("00_ranks_and_magics.ipynb", "2xT4", "1", None)]
    assert (out / "summary.txt").read_text().splitlines()[0] == "profile 2xT4, -n 2, DDP_SMALL=1"


def test_a_host_too_small_for_every_ranks_135m_gets_the_random_smollm2_and_says_so(recorded, monkeypatch, capsys):
    calls, out = recorded
    monkeypatch.setattr(run, "host_available_gb", lambda: 23.0)  # this VM: 8 ranks x 2.85 GB were OOM-killed
    assert run.main(["--profile", "8xH100", "-n", "8", "--fast", "--out", str(out), "00"]) == 0
    assert os.environ[RANDOM_ENV] == "random"
    assert "the lessons load the random small SmolLM2 instead" in capsys.readouterr().out
    assert (out / "summary.txt").read_text().splitlines()[0].endswith("DDP_SMOLLM2=random")


def test_a_host_with_room_keeps_the_packaged_135m_and_a_choice_made_outside_is_kept(recorded, monkeypatch):
    calls, out = recorded
    monkeypatch.setattr(run, "host_available_gb", lambda: 23.0)
    assert run.main(["-n", "2", "--out", str(out), "00"]) == 0  # 2 x 3 GB fit
    assert RANDOM_ENV not in os.environ
    monkeypatch.setenv(RANDOM_ENV, "packaged")  # not "random": the runner leaves the learner's setting alone
    assert run.main(["-n", "8", "--out", str(out), "00"]) == 0
    assert os.environ[RANDOM_ENV] == "packaged"


def test_the_learners_line_gets_the_ranks_asked_for_and_nothing_else():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("%dist_init -n 2"),
                                         nbformat.v4.new_code_cell("%dist_init -n 2 --cpu\nx = 1"),
                                         nbformat.v4.new_code_cell("%dist_init -n 4"),
                                         nbformat.v4.new_markdown_cell("%dist_init -n 2")])
    run.set_ranks(8)(nb)
    assert [c.source for c in nb.cells] == ["%dist_init -n 8", "%dist_init -n 8 --cpu\nx = 1", "%dist_init -n 4",
                                            "%dist_init -n 2"]


def test_the_first_error_cell_is_named(tmp_path):
    err = nbformat.v4.new_output("error", ename="KeyError", evalue="('gloo', 2)", traceback=[])
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("ok"), nbformat.v4.new_code_cell("boom")])
    nb.cells[1].outputs = [err]
    nb.cells[1].id = "c36"
    nbformat.write(nb, tmp_path / "x.ipynb")
    assert run.first_error(tmp_path / "x.ipynb") == "cell 1 [c36]: KeyError: ('gloo', 2)"
    assert run.first_error(tmp_path / "missing.ipynb") is None


def test_a_lesson_refusing_too_few_ranks_is_reported_as_refused_not_failed(recorded, monkeypatch):
    calls, out = recorded
    refusal = ("RankError: 1 rank(s) failed: rank 0: RuntimeError: this lesson compares ranks and needs at least 2, "
               "but 1 run it: %dist_shutdown, then %dist_init -n 2")
    errors = {"00_ranks_and_magics": "cell 5 [c05]: " + refusal,
              "01_collectives_and_benchmarks": "cell 3 [c03]: KeyError: 2"}

    def execute(path, out, timeout, cwd, edit):
        raise RuntimeError("a cell failed")
    monkeypatch.setattr(run, "execute", execute)
    monkeypatch.setattr(run, "first_error", lambda out: errors[out.stem])
    assert run.main(["-n", "1", "--out", str(out), "00", "01"]) == 1  # 01 failed: exit 1
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[1].startswith("00_ranks_and_magics: refused (") and lines[1].endswith(
        "at cell 5 [c05]: needs at least 2 ranks, 1 ran it")
    assert lines[2].startswith("01_collectives_and_benchmarks: FAILED (") and "KeyError: 2" in lines[2]
    assert lines[3].startswith("0 of 2 lessons ran clean, 1 refused clearly in ")
    assert run.main(["-n", "1", "--out", str(out), "00"]) == 0  # a refusal alone is not a failure


def test_cis_shards_cover_every_lesson_and_run_lesson_01_before_the_lessons_that_read_its_fit():
    from ddp_lib.course.tutorial import NOTEBOOKS, lesson_paths

    lessons = {p.name[:2] for p in lesson_paths(None, NOTEBOOKS)}
    assert lessons == {lesson for shard in run.CI_SHARDS for lesson in shard}  # a new lesson needs a shard
    for shard in run.CI_SHARDS:
        for reader in {"04", "05"} & set(shard):  # load_fit: no reference fit under NCCL
            assert "01" in shard and shard.index("01") < shard.index(reader), shard


def test_a_named_shard_runs_its_lessons_only_and_auto_follows_the_commit_count(recorded, monkeypatch, capsys):
    calls, out = recorded
    assert run.main(["--fast", "--out", str(out), "--ci-shard", "1"]) == 0
    assert [c[0][:2] for c in calls] == list(run.CI_SHARDS[1])
    assert "CI shard 1 of 5: lessons 01 05" in capsys.readouterr().out
    calls.clear()
    monkeypatch.setattr(run, "commit_count", lambda: 5 * 7 + 3)
    assert run.main(["--fast", "--out", str(out), "--ci-shard", "auto"]) == 0
    assert [c[0][:2] for c in calls] == list(run.CI_SHARDS[3])


def test_auto_outside_a_git_checkout_says_to_name_a_shard(monkeypatch, tmp_path):
    monkeypatch.setattr(run, "ROOT", tmp_path)  # no .git here, nor above it under /tmp
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    with pytest.raises(SystemExit, match="name a shard instead, 0 to 4"):
        run.ci_shard("auto")


@pytest.mark.parametrize("argv", [["--ci-shard", "5"], ["--ci-shard", "-1"], ["--ci-shard", "1", "02"]])
def test_a_shard_that_does_not_exist_or_with_lessons_named_too_is_refused(recorded, argv):
    calls, out = recorded
    with pytest.raises(SystemExit) as e:
        run.main(["--out", str(out), *argv])
    assert e.value.code != 0 and not calls


def test_dry_mode_runs_the_real_sizes_and_records_each_lessons_peaks(recorded, monkeypatch):
    calls, out = recorded
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    assert run.main(["--dry", "--fast", "--out", str(out), "00"]) == 0
    assert calls == [("00_ranks_and_magics.ipynb", "2xT4", None, "1")]  # no DDP_SMALL: the card decides
    assert os.environ[DRY_ENV] == "1"
    peaks = json.loads((out / "peaks.json").read_text())["lessons"]["00_ranks_and_magics"]
    # per GPU: the most one process held, and the sum over the processes on it; host: the largest process
    assert peaks["gpu_peak_gib"] == {"0": 3.0, "1": 1.0} and peaks["gpu_sum_gib"] == {"0": 4.0, "1": 1.0}
    assert peaks["host_max_rss_gib"] == 1.0 and peaks["result"].startswith("ok (")
    assert (out / "summary.txt").read_text().splitlines()[0] == "profile 2xT4, -n 2, dry, real sizes DDP_NBVAL=1"


def test_a_dry_ci_shard_runs_only_its_lessons_that_run_clean_dry_and_names_the_others(recorded, monkeypatch, capsys):
    calls, out = recorded
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    monkeypatch.setattr(run, "DRY_CI_OK", ("02",))
    assert run.main(["--dry", "--fast", "--out", str(out), "--ci-shard", "3"]) == 0  # shard 3: 02 09
    assert [c[0][:2] for c in calls] == ["02"]
    assert "fail dry on a 2xT4, not run: 09" in capsys.readouterr().out


def test_the_docs_table_of_dry_peaks_is_written_from_peaks_json(tmp_path):
    for profile, gib in (("2xT4", 14.1), ("8xH100", 38.9)):
        (tmp_path / f"{profile}.json").write_text(json.dumps({"profile": profile, "n": 2, "lessons": {
            "05_overlap_and_buckets": {"result": "FAILED (74 s, 21 s CPU) at cell 21 [c19]: RankError: 2 rank(s) "
                                                 "failed: rank 0: OutOfMemoryError: CUDA out of memory; rank 1: x",
                                       "gpu_peak_gib": {"1": gib, "0": gib}, "host_max_rss_gib": 0.5}}}))
    rows = _peaks.table([tmp_path / "2xT4.json", tmp_path / "8xH100.json"]).splitlines()
    assert rows[0] == "| lesson | 2xT4 -n 2 | 8xH100 -n 2 |"
    assert rows[2] == ("| 05 | FAILED at cell 21 [c19]: OutOfMemoryError: CUDA out of memory; GPU GiB [14.10, 14.10]; "
                       "host 0.5 GiB | FAILED at cell 21 [c19]: OutOfMemoryError: CUDA out of memory; GPU GiB "
                       "[38.90, 38.90]; host 0.5 GiB |")


def test_the_docs_table_names_a_rank_that_died_not_its_peers_lost_connection(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"profile": "2xA100", "n": 2, "lessons": {"07_zero1_and_memory": {
        "result": "FAILED (276 s, 129 s CPU) at cell 16 [bca960a9]: RankError: 2 rank(s) failed: rank 0: RuntimeError: "
                  "[pair.cc:553] Connection closed by peer; rank 1: died (exit code -9)",
        "gpu_peak_gib": {"0": 23.77, "1": 23.77}, "host_max_rss_gib": 6.07}}}))
    assert _peaks.table([tmp_path / "p.json"]).splitlines()[2] == (
        "| 07 | FAILED at cell 16 [bca960a9]: rank 1 died (exit code -9); GPU GiB [23.77, 23.77]; host 6.1 GiB |")


def test_a_cpu_process_on_a_simulated_box_records_its_host_peak(tmp_path):
    # a 1-GPU box's gloo ranks (CUDA_VISIBLE_DEVICES=""): their host memory belongs in the lesson's peaks
    import subprocess
    import sys

    env = dict(os.environ, **{ENV: "1xH100", "CUDA_VISIBLE_DEVICES": "", _peaks.ENV: str(tmp_path)})
    env.pop(DRY_ENV, None)
    done = subprocess.run([sys.executable, "-c", "import ddp_lib, torch; x = torch.ones(2**22)"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert len(records) == 1 and records[0]["gpu_peak_bytes"] == {}
    assert records[0]["host_max_rss_bytes"] > 2**24  # at least the 16 MiB tensor it wrote
    assert _peaks.collect(tmp_path)["host_max_rss_gib"] > 0
