"""Mutation suite of lesson 09's resume checker (ddp_lib.check.check_resume), on 2 gloo ranks in one spawned group,
and the elastic job it stands for: killed under torchrun, restarted, on the uninterrupted run's loss curve."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from ddp_lib.apps import elastic
from ddp_lib.launch import spawn

from _mutations import group_intact, run_case, suite_tests

LIMIT_S = 20.0


def _state(model, opt, sched, step):
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "step": step, "rng": torch.get_rng_state()}


def _restore(state, model, opt, sched, rng=True, optimizer=True, scheduler=True):
    model.load_state_dict(state["model"])
    if optimizer:
        opt.load_state_dict(state["optimizer"])
    if scheduler:
        sched.load_state_dict(state["scheduler"])
    if rng:
        torch.set_rng_state(state["rng"])
    return state["step"]


def _atomic_save(state, path):
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------- right answers
def save_lesson(path, model, opt, sched, step):  # the lesson's solution (= the package's)
    elastic.save_checkpoint(path, model, opt, sched, step)


def load_lesson(path, model, opt, sched):
    return elastic.load_checkpoint(path, model, opt, sched)


def save_tempfile(path, model, opt, sched, step):  # right, another way: mkstemp beside the path, a nested dict
    fd, tmp = tempfile.mkstemp(dir=Path(path).parent, suffix=".partial")
    with os.fdopen(fd, "wb") as f:
        torch.save({"train": {"weights": model.state_dict(), "adam": opt.state_dict()},
                    "sched": sched.state_dict(), "meta": {"done": step, "torch_rng": torch.random.get_rng_state()}}, f)
    Path(tmp).replace(path)


def load_tempfile(path, model, opt, sched):
    s = torch.load(path, weights_only=False)
    model.load_state_dict(s["train"]["weights"])
    opt.load_state_dict(s["train"]["adam"])
    sched.load_state_dict(s["sched"])
    torch.random.set_rng_state(s["meta"]["torch_rng"])
    return int(s["meta"]["done"])


def save_two_files(path, model, opt, sched, step):  # right: weights and the rest apart, one rename commits both
    folder = Path(f"{path}.d.tmp")
    folder.mkdir(exist_ok=True)
    torch.save(model.state_dict(), folder / "model.pt")
    torch.save({k: v for k, v in _state(model, opt, sched, step).items() if k != "model"}, folder / "rest.pt")
    torch.save({"dir": folder.name.removesuffix(".tmp") + f".{step}"}, f"{path}.ptr.tmp")
    folder.rename(Path(path).parent / (folder.name.removesuffix(".tmp") + f".{step}"))
    os.replace(f"{path}.ptr.tmp", path)


def load_two_files(path, model, opt, sched):
    folder = Path(path).parent / torch.load(path)["dir"]
    rest = torch.load(folder / "rest.pt")
    return _restore({"model": torch.load(folder / "model.pt"), **rest}, model, opt, sched)


# ------------------------------------------------------------------------------------- planted mistakes
def save_plain(path, model, opt, sched, step):
    _atomic_save(_state(model, opt, sched, step), path)


def load_no_optimizer(path, model, opt, sched):  # "the weights are what matter"
    return _restore(torch.load(path), model, opt, sched, optimizer=False)


def load_no_rng(path, model, opt, sched):  # a new process draws another data order and other dropout masks
    return _restore(torch.load(path), model, opt, sched, rng=False)


def load_no_scheduler(path, model, opt, sched):  # the learning rate starts its decay over
    return _restore(torch.load(path), model, opt, sched, scheduler=False)


def load_scheduler_caught_up(path, model, opt, sched):  # restores it, then steps it "to catch up"
    step = _restore(torch.load(path), model, opt, sched)
    sched.step()
    return step


def load_next_step(path, model, opt, sched):  # off by one: returns the step it thinks comes next
    return _restore(torch.load(path), model, opt, sched) + 1


def save_not_atomic(path, model, opt, sched, step):  # torch.save straight onto the path
    torch.save(_state(model, opt, sched, step), path)


def load_plain(path, model, opt, sched):
    return _restore(torch.load(path), model, opt, sched)


def stub(*args):
    raise NotImplementedError("your turn")


SUITES = {"resume": {
    "right: lesson": (save_lesson, load_lesson),
    "right: mkstemp, nested dict": (save_tempfile, load_tempfile),
    "right: two files, one rename": (save_two_files, load_two_files),
    "no optimizer": (save_plain, load_no_optimizer),
    "no RNG": (save_plain, load_no_rng),
    "no scheduler": (save_plain, load_no_scheduler),
    "scheduler stepped on load": (save_plain, load_scheduler_caught_up),
    "returns the next step": (save_plain, load_next_step),
    "not atomic": (save_not_atomic, load_plain),
}}

MISTAKES = [  # (suite, planted mistake, the property it fails, words of its diagnosis)
    ("resume", "no optimizer", "restores the optimizer state", "the optimizer has no state after load"),
    ("resume", "no RNG", "restores the random stream", "torch.get_rng_state()"),
    ("resume", "no scheduler", "restores the learning-rate schedule", "after load the schedule is at step 0"),
    ("resume", "scheduler stepped on load", "restores the learning-rate schedule", "after load the schedule is at step 4"),
    ("resume", "returns the next step", "returns the step to go on from", "load returned 4"),
    ("resume", "not atomic", "a crash while saving keeps the last checkpoint", "left atomic.pt unreadable"),
]


def run_all() -> dict:
    """On each rank: every case in order, then the stub; then one all-reduce on the default group."""
    import shutil

    from ddp_lib.check import check_resume

    scratch = tempfile.mkdtemp(prefix="test-check-restart-")
    tempfile.tempdir = scratch  # where the checker makes its folder: what it leaves behind is seen here alone
    try:
        out = {(suite, name): run_case(check_resume, save, load, timeout_s=LIMIT_S)
               for suite, cases in SUITES.items() for name, (save, load) in cases.items()}
        res = check_resume(stub, stub, timeout_s=LIMIT_S)
        out["stub"] = {r.name: r.status for r in res.rows}
        out["left in the temp folder"] = sorted(os.listdir(scratch))
    finally:
        tempfile.tempdir = None
        shutil.rmtree(scratch, ignore_errors=True)
    return group_intact(out)


@pytest.fixture(scope="module")
def results():
    return spawn(run_all, 2, backend="gloo", timeout_s=240)


def test_no_check_runs_past_its_limit(results):
    slow = {k: round(v["seconds"], 1) for k, v in results[0].items()
            if isinstance(k, tuple) and v["seconds"] > LIMIT_S}
    assert not slow, slow


def test_the_checker_leaves_no_checkpoint_behind(results):
    """Each check writes the learner's checkpoints into a folder of its own and removes it, passed or failed."""
    assert results[0]["left in the temp folder"] == [] == results[1]["left in the temp folder"]


def test_a_stub_reads_not_written_yet(results):
    assert set(results[0]["stub"].values()) <= {"not written yet", "not checked"}, results[0]["stub"]
    assert "not written yet" in results[0]["stub"].values()


# what every mutation suite asserts on its results (one copy: tests/_mutations.py)
(test_same_verdict_on_every_rank_and_group_intact, test_right_answers_written_another_way_pass,
 test_planted_mistake_fails_its_property_with_one_diagnosis, test_suites_are_big_enough) = suite_tests(SUITES, MISTAKES)


@pytest.mark.slow
def test_a_killed_job_resumes_on_the_uninterrupted_curve(tmp_path):
    """The lesson's job: rank 1 SIGKILLs itself, torchrun restarts the group, which resumes from the last commit."""
    job = elastic.run_job(tmp_path, kill_at=7, steps=10, save_every=3)
    agent = elastic.wait_job(job, timeout_s=240)
    assert job.returncode == 0, agent[-3000:]
    log = elastic.read_losses(tmp_path)
    assert {e["attempt"] for e in log} == {0, 1}, log
    assert "attempt 1: resumed after step 6" in agent, agent[-3000:]
    assert [e["step"] for e in log if e["attempt"] == 1] == [7, 8, 9, 10]
    want = spawn(_uninterrupted, 2, backend="gloo", timeout_s=120)[0]
    final = {e["step"]: e["loss"] for e in log}
    assert [final[s] for s in range(1, 11)] == want  # bit for bit


def _uninterrupted() -> list[float]:
    return elastic.train(steps=10)


def test_a_wait_that_ends_early_ends_the_job_and_its_workers(tmp_path):
    """An interrupted lesson cell left torchrun and both workers running, still writing into the folder that the
    cell's next run starts afresh (seen re-running lesson 09's cell). The timeout ends the wait the same way."""
    import subprocess
    import time

    from ddp_lib.launch import descendants

    job = elastic.run_job(tmp_path, steps=100_000, save_every=100_000)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(descendants(job.pid)) < 2 and time.monotonic() < deadline:  # the agent has started its 2 workers
            time.sleep(0.2)
        workers = descendants(job.pid)
        assert len(workers) >= 2, "torchrun never started its workers"
        with pytest.raises(subprocess.TimeoutExpired):
            elastic.wait_job(job, timeout_s=1)
        assert job.poll() is not None
        gone_by = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{p}") for p in workers) and time.monotonic() < gone_by:
            time.sleep(0.2)
        assert not [p for p in workers if os.path.exists(f"/proc/{p}")], "workers outlived the job"
    finally:  # whatever failed above, nothing this test started stays (each ended by PID)
        for pid in [*workers, job.pid]:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        job.wait()


AGENT_IGNORING_SIGTERM = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_an_agent_deaf_to_sigterm_goes_with_its_workers(tmp_path):
    """The last resort: an agent still running after the grace is killed with its process group, workers included
    (a SIGKILL of the agent alone would orphan them)."""
    import subprocess
    import sys
    import time

    job = subprocess.Popen([sys.executable, "-c", AGENT_IGNORING_SIGTERM], stdout=subprocess.PIPE, text=True,
                           start_new_session=True)  # as run_job starts torchrun
    worker = None
    try:
        worker = int(job.stdout.readline())
        with pytest.raises(subprocess.TimeoutExpired):
            elastic.wait_job(job, timeout_s=0.5, grace_s=1)
        assert job.poll() is not None
        gone_by = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < gone_by:
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its agent"
    finally:  # whatever failed above, nothing this test started stays (each ended by PID)
        for pid in [p for p in (worker, job.pid) if p]:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        job.wait()


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the GPU's random stream")
def test_on_a_gpu_the_check_compares_the_gpus_random_stream(monkeypatch, tmp_path):
    """On a GPU the check trains on the GPU, where dropout draws from the GPU's generator: the lesson's answer
    restores it and resumes on the curve; an answer that restores only the CPU stream is caught."""
    from ddp_lib.check import restart

    monkeypatch.setattr(restart, "comm_device", lambda: torch.device("cuda", 0))
    good = restart._run(save_lesson, load_lesson, tmp_path)
    assert torch.equal(good["restored"]["cuda_rng"], good["at_save"]["cuda_rng"])
    assert max(abs(a - b) for a, b in zip(good["got"], good["want"])) <= 1e-6
    bad = restart._run(save_plain, load_plain, tmp_path)
    assert torch.equal(bad["restored"]["rng"], bad["at_save"]["rng"])  # the CPU stream alone is restored
    assert not torch.equal(bad["restored"]["cuda_rng"], bad["at_save"]["cuda_rng"])
