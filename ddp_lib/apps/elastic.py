"""Lesson 09's elastic job: a small DDP training run that survives a rank's death under torchrun.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m ddp_lib.apps.elastic --out DIR --kill-at 13

Every rank checkpoints its own state (weights, AdamW, the learning-rate schedule, the step and its random
stream, which draws both its data and its dropout) every `--save-every` steps; once every rank has written,
rank 0 commits the step by renaming a `latest` file, so a job killed between two ranks' writes never resumes
from a half-written step. With `--kill-at K`, rank 1 SIGKILLs itself at step K of the first attempt; torchrun
then stops the other rank and starts the group again (`TORCHELASTIC_RESTART_COUNT` 1), which resumes from the
last committed step. Rank 0 appends `{"step", "loss", "attempt"}` lines to DIR/losses.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib import comm

IN, OUT, BATCH = 16, 4, 8


def build(steps: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The model (with dropout, so the random stream matters), AdamW and a linear decay over `steps`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, OUT))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=steps)
    return model, opt, sched


def batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The next batch of this rank's data, drawn from torch's global random stream (a shuffled loader's role)."""
    x = torch.randn(BATCH, IN)
    return x.to(device), (x[:, :OUT].sum(1) > 0).long().to(device) + 2 * (x[:, OUT] > 0).long().to(device)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, sched, device: torch.device) -> torch.Tensor:
    """One step on the next batch; returns the loss (detached)."""
    x, y = batch(device)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    sched.step()
    return loss.detach()


def save_checkpoint(path: str | os.PathLike, model: nn.Module, opt: torch.optim.Optimizer, sched,
                    step: int) -> None:
    """Write everything a resumed run needs after `step` finished steps to `path`, atomically."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "step": step, "rng": torch.get_rng_state()}
    device = next(model.parameters()).device
    if device.type == "cuda":  # dropout on a GPU draws from that GPU's own generator, not the CPU's
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a rename is atomic: a crash leaves the old file or the new one, never half of one


def load_checkpoint(path: str | os.PathLike, model: nn.Module, opt: torch.optim.Optimizer, sched) -> int:
    """Restore `path` into freshly built objects and the random stream; return the step to go on from."""
    state = torch.load(path, map_location="cpu")  # RNG states must stay CPU tensors
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    if "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], next(model.parameters()).device)
    return state["step"]


def train(steps: int = 24, save_every: int = 5, out: Path | None = None, kill_at: int | None = None,
          group: dist.ProcessGroup | None = None) -> list[float]:
    """The job's loop on CPU ranks (`group`: gloo, default the default group); returns the losses it ran.

    With `out`, it resumes from the last committed step there, checkpoints every `save_every` steps, and rank 0
    logs each loss to out/losses.jsonl; `kill_at`: rank 1 SIGKILLs itself there on the first attempt."""
    rank, ws = dist.get_rank(group), dist.get_world_size(group)
    attempt, device = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), torch.device("cpu")
    model, opt, sched = build(steps)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    torch.manual_seed(1000 + rank)  # each rank its own data and dropout stream
    start, latest, losses = 0, (out / "latest") if out else None, []
    if latest is not None and latest.is_file():  # a restarted attempt: go on from the last committed step
        start = load_checkpoint(out / latest.read_text().strip() / f"rank{rank}.pt", model, opt, sched)
        if rank == 0:
            print(f"[elastic] attempt {attempt}: resumed after step {start}", flush=True)
    for step in range(start, steps):
        if kill_at is not None and step == kill_at and rank == 1 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost node: no exception, no cleanup, no goodbye
        loss = train_step(ddp, opt, sched, device)
        comm.all_reduce(loss, group)  # the job's loss: the mean over ranks
        losses.append(loss.item() / ws)
        if out is not None and rank == 0:
            with open(out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step + 1, "loss": losses[-1], "attempt": attempt}) + "\n")
        if out is not None and (step + 1) % save_every == 0:
            name = f"step{step + 1:05d}"
            (out / name).mkdir(parents=True, exist_ok=True)
            save_checkpoint(out / name / f"rank{rank}.pt", model, opt, sched, step + 1)
            comm.barrier(group)  # every rank's file is on disk before the step is committed
            if rank == 0:
                (out / "latest.tmp").write_text(name)
                os.replace(out / "latest.tmp", latest)  # the commit
    return losses


def main(argv: list[str] | None = None) -> None:
    """Under torchrun: gloo on the CPU (asked for explicitly: the demo is about restarts, not speed)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=None, help="rank 1 kills itself at this step (first attempt)")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    train(args.steps, args.save_every, Path(args.out), args.kill_at)
    dist.destroy_process_group()


def run_job(out: str | os.PathLike, kill_at: int | None = None, steps: int = 24, save_every: int = 5,
            max_restarts: int = 1) -> subprocess.Popen:
    """Start `main` under torchrun with 2 CPU ranks, a standalone rendezvous on a free port; returns the process."""
    Path(out).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()  # a notebook rank's own process-group variables would leak in
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")}
    # torchrun shares its rendezvous TCPStore with the workers by default; there, on torch 2.13, the restarted
    # ranks read the first attempt's gloo addresses and fail to connect (tried; pytorch issue #135712)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", str(max_restarts), "--monitor-interval", "0.1", "-m", "ddp_lib.apps.elastic",
           "--out", str(out), "--steps", str(steps), "--save-every", str(save_every)]
    if kill_at is not None:
        cmd += ["--kill-at", str(kill_at)]
    # a session of its own: its process group is the agent and its workers, for `wait_job`'s last resort
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_job(job: subprocess.Popen, timeout_s: float = 300.0, grace_s: float = 30.0) -> str:
    """The job's output once it has ended. Whatever ends the wait first (an interrupted cell, the timeout) ends the job
    too, then is raised: torchrun's agent stops its workers on SIGTERM, so no job of an earlier run goes on writing
    into the folder the next run starts afresh. An agent still running `grace_s` later is killed with its whole process
    group (`run_job` starts it in a session of its own): its workers too, which a SIGKILL of the agent alone orphans."""
    try:
        return job.communicate(timeout=timeout_s)[0]
    except BaseException:
        job.terminate()
        try:
            job.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            try:
                if os.getpgid(job.pid) != job.pid:  # not started by `run_job`: the agent alone
                    raise ProcessLookupError
                os.killpg(job.pid, signal.SIGKILL)  # the group `run_job` started: the agent and its workers
            except (ProcessLookupError, PermissionError):
                job.kill()
            job.wait()
        raise


def read_losses(out: str | os.PathLike) -> list[dict]:
    """Every line rank 0 logged, in order (a resumed attempt logs the steps after its checkpoint again)."""
    return [json.loads(line) for line in Path(out, "losses.jsonl").read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    main()
