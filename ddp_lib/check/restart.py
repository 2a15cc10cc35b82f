"""Checker of lesson 09's resume step: a checkpoint that lets a killed job go on as if it had never stopped."""

from __future__ import annotations

import copy
import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ddp_lib.apps.elastic import build, train_step
from ddp_lib.check._runner import CheckResult, Mismatch, Property, max_diff, run_check
from ddp_lib.devices import comm_device, needs_process_group

STEPS, SAVED_AT = 8, 3


class _Killed(BaseException):
    """The process "dies" inside torch.save: a BaseException, so no `except Exception` in the answer swallows it."""


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    """Copies, not references: state_dict() hands out the live tensors that the next steps update in place."""
    device = next(model.parameters()).device
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return copy.deepcopy({"params": model.state_dict(), "opt": opt.state_dict(), "lr": sched.get_last_lr(),
                          "epoch": sched.last_epoch, "rng": torch.get_rng_state(), "cuda_rng": cuda_rng})


def _build_on(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The job's objects, the model on `device`: on a GPU its dropout draws from the GPU's generator."""
    model, opt, sched = build(STEPS)
    model.to(device)  # in place: the optimizer keeps the same parameters
    return model, opt, sched


def _run(save: Callable, load: Callable, folder: Path) -> dict[str, Any]:
    """Train SAVED_AT steps, save, go on to STEPS (the uninterrupted run); then load into fresh objects with the
    random stream scrambled, and record what was restored and the rest of the run."""
    dev = comm_device()
    model, opt, sched = _build_on(dev)
    torch.manual_seed(7)  # seeds every device's generator
    for _ in range(SAVED_AT):
        train_step(model, opt, sched, dev)
    path = folder / "ckpt.pt"
    save(path, model, opt, sched, SAVED_AT)
    at_save = _snapshot(model, opt, sched)
    want = [train_step(model, opt, sched, dev).item() for _ in range(SAVED_AT, STEPS)]
    final = copy.deepcopy(model.state_dict())

    fresh, fresh_opt, fresh_sched = _build_on(dev)
    torch.manual_seed(12345)  # a new process: other random streams, on the CPU and the GPU
    step = load(path, fresh, fresh_opt, fresh_sched)
    restored = _snapshot(fresh, fresh_opt, fresh_sched)
    got = [train_step(fresh, fresh_opt, fresh_sched, dev).item() for _ in range(step if isinstance(step, int)
                                                                                 else STEPS, STEPS)]
    return {"at_save": at_save, "restored": restored, "step": step, "want": want, "got": got, "final": final,
            "got_final": fresh.state_dict()}


def _opt_tensors(state: dict) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            for i, s in state["state"].items() for k, v in s.items()}


@needs_process_group
def check_resume(save: Callable, load: Callable, timeout_s: float | None = None) -> CheckResult:
    """`save(path, model, optimizer, scheduler, step)` writes to `path`, atomically, what a job needs to go on
    after `step` finished steps; `load(path, model, optimizer, scheduler)` restores it into freshly built objects
    and torch's random stream, and returns the step to go on from. Each rank checks on its own (no collective)."""
    folder = Path(tempfile.mkdtemp(prefix="ddp-resume-"))
    res = _Resume(save, load, folder)
    restored = ("restores the weights", "restores the optimizer state", "restores the learning-rate schedule",
                "restores the random stream", "returns the step to go on from")
    try:
        return run_check("resume", [
            Property("restores the weights", res.weights,
                     "save model.state_dict(); load_state_dict into the new model"),
            Property("restores the optimizer state", res.optimizer,
                     "save optimizer.state_dict() (AdamW's moments and step) and load it"),
            Property("restores the learning-rate schedule", res.schedule, "save scheduler.state_dict() and load it"),
            Property("restores the random stream", res.rng,
                     "save torch.get_rng_state() (data order, dropout; on a GPU torch.cuda.get_rng_state(device) "
                     "too) and set them on load"),
            Property("returns the step to go on from", res.step, "save the step and return it from load"),
            Property("same loss curve as an uninterrupted run", res.curve,
                     "restore everything above, then train from the returned step", needs=restored),
            Property("a crash while saving keeps the last checkpoint", res.atomic,
                     "torch.save to a temporary file beside the path, then os.replace(tmp, path)",
                     needs=("restores the weights", "returns the step to go on from")),
        ], timeout_s)
    finally:  # the checkpoints written by the learner's save: nothing left in the temp folder
        shutil.rmtree(folder, ignore_errors=True)


class _Resume:
    """The setup (the learner's save and load, a temporary folder), the one run every property reads, memoised,
    and one method per property's evidence."""

    def __init__(self, save: Callable, load: Callable, folder: Path) -> None:
        self.save, self.load, self.folder = save, load, folder
        self.memo: dict[str, dict] = {}

    def run(self) -> dict[str, Any]:
        if "run" not in self.memo:
            self.memo["run"] = _run(self.save, self.load, self.folder)
        return self.memo["run"]

    def weights(self) -> float:
        r = self.run()
        return max_diff(r["restored"]["params"], r["at_save"]["params"], what="weight ")

    def optimizer(self) -> float:
        r = self.run()
        saved, got = _opt_tensors(r["at_save"]["opt"]), _opt_tensors(r["restored"]["opt"])
        if not got:
            raise Mismatch("the optimizer has no state after load (AdamW's exp_avg, exp_avg_sq, step): save "
                           "optimizer.state_dict() and load it with optimizer.load_state_dict")
        return max_diff(got, saved, what="optimizer state ")

    def schedule(self) -> None:
        r = self.run()
        if r["restored"]["epoch"] != r["at_save"]["epoch"] or r["restored"]["lr"] != r["at_save"]["lr"]:
            raise Mismatch(f"after load the schedule is at step {r['restored']['epoch']} (lr "
                           f"{r['restored']['lr'][0]:.4g}); it was saved at {r['at_save']['epoch']} (lr "
                           f"{r['at_save']['lr'][0]:.4g}): save scheduler.state_dict() and load it")

    def rng(self) -> None:
        r = self.run()
        if not torch.equal(r["restored"]["rng"], r["at_save"]["rng"]):
            raise Mismatch("torch's random stream after load is not the one at save: the next batch and dropout "
                           "mask differ; save torch.get_rng_state() and restore it with torch.set_rng_state")
        saved_gpu, restored_gpu = r["at_save"]["cuda_rng"], r["restored"]["cuda_rng"]
        if saved_gpu is not None and not torch.equal(restored_gpu, saved_gpu):
            raise Mismatch("the GPU's random stream after load is not the one at save: dropout on a GPU draws from "
                           "it; save torch.cuda.get_rng_state(device) too and restore it with torch.cuda.set_rng_state")

    def step(self) -> None:
        r = self.run()
        if r["step"] != SAVED_AT:
            raise Mismatch(f"load returned {r['step']!r} for a checkpoint saved after {SAVED_AT} steps: return "
                           "the saved step, the number of steps already done")

    def curve(self) -> float:
        r = self.run()
        if len(r["got"]) != len(r["want"]):
            raise Mismatch(f"the resumed run took {len(r['got'])} steps where {len(r['want'])} were left")
        diff = max((abs(a - b) for a, b in zip(r["got"], r["want"])), default=0.0)
        if diff > 1e-6:
            raise Mismatch(f"the resumed losses differ from the uninterrupted run's by {diff:.2e}", diff)
        return max(diff, max_diff(r["got_final"], r["final"], what="final weight "))

    def atomic(self) -> None:
        path = self.folder / "atomic.pt"
        model, opt, sched = build(STEPS)
        self.save(path, model, opt, sched, 1)
        train_step(model, opt, sched, torch.device("cpu"))
        real = torch.save

        def dies_halfway(obj: Any, f: Any, *a: Any, **k: Any) -> None:
            buf = io.BytesIO()
            real(obj, buf, *a, **k)
            half = buf.getvalue()[: len(buf.getvalue()) // 2]
            if isinstance(f, (str, os.PathLike)):
                with open(f, "wb") as fh:
                    fh.write(half)
            else:
                f.write(half)
            raise _Killed("killed while writing")

        torch.save = dies_halfway
        try:
            self.save(path, model, opt, sched, 2)
        except _Killed:
            pass
        finally:
            torch.save = real
        fresh, fresh_opt, fresh_sched = build(STEPS)
        try:
            got = self.load(path, fresh, fresh_opt, fresh_sched)
        except Exception as e:  # noqa: BLE001 - a half-written file is the failure this property is about
            raise Mismatch(f"a job killed inside save left {path.name} unreadable ({type(e).__name__}): write a "
                           "temporary file in the same folder, then os.replace it onto the path") from None
        if got != 1:
            raise Mismatch(f"after a crash inside save, load returned {got!r}: the previous checkpoint (step 1) "
                           "must still be there, whole")
