"""Shared by the export tests: a small BucketedDDP training notebook, run for real, and launchers cleaned up by PID."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from ddp_lib.notebook.job import end_tree

STEPS = 8
# not anchored to lines: two ranks sharing one pipe (torchrun's, srun's) can interleave a print's text and its newline,
# which Python writes separately; a float's repr ends where the next rank's "rank" begins
LOSS = re.compile(r"rank (\d+) step (\d+) loss (-?\d+(?:\.\d+)?(?:e[+-]?\d+)?)")

# The cells a learner would have after lesson 05, cut to a training run that takes seconds: their own BucketedDDP
# (here the package's, public import), a checkpoint every 2 steps when a job gives CKPT_DIR (lesson 09's resume).
CELLS = [
    "import matplotlib  # a kernel cell: runs before %dist_init, in the kernel only",
    "%load_ext ddp_lib.notebook\n%dist_init -n 2 --cpu",
    f"""import os
import time
import torch.nn.functional as F
from ddp_lib.apps.resume import load_checkpoint, save_checkpoint
from ddp_lib.kit.data import shard_batch
from ddp_lib.ddp import BucketedDDP
from ddp_lib.kit.models import ToyModel

STEPS = {STEPS}
CKPT_DIR = os.environ.get("CKPT_DIR")  # a job's checkpoint folder; unset in the notebook: no checkpoints
STOP_AFTER = int(os.environ.get("STOP_AFTER", "0"))  # tests: the first run requeues itself after this step""",
    """torch.manual_seed(0)
model = ToyModel(32, 64, 8).to(device)
ddp = BucketedDDP(model, bucket_size_mb=0.005)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
start = 0
if CKPT_DIR and os.path.exists(os.path.join(CKPT_DIR, "state.pt")):
    start = load_checkpoint(CKPT_DIR, model, ddp, opt, sched)["step"]
    print(f"rank {rank} resumed after step {start}")""",
    """for step in range(start, STEPS):
    gen = torch.Generator().manual_seed(1000 + step)  # the step's global batch: the same on every rank and run
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
    x, y = shard_batch(x, rank, world_size).to(device), shard_batch(y, rank, world_size).to(device)
    opt.zero_grad()
    loss = F.mse_loss(ddp(x), y)
    loss.backward()
    ddp.finish_gradient_synchronization()
    opt.step()
    sched.step()
    print(f"rank {rank} step {step} loss {loss.item()!r}")
    if CKPT_DIR and (step + 1) % 2 == 0:
        save_checkpoint(CKPT_DIR, model, ddp, opt, sched, step + 1)
    if STOP_AFTER == step + 1 and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        if rank == 0:  # what a preemption does to the job: SLURM kills it and queues it again
            os.system(f"scontrol requeue {os.environ['SLURM_JOB_ID']}")
        time.sleep(300)""",
    "%%rank [0]\nprint(f\"rank 0 done: {STEPS} steps, lr now {sched.get_last_lr()[0]:g}\")",
    "%dist_shutdown",
]


def write_notebook(path: Path) -> Path:
    """The training notebook, not yet run."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    nbformat.write(nb, str(path))
    return path


def notebook_losses(path: Path) -> dict[tuple[int, int], str]:
    """(rank, step) -> the loss each rank printed, from an executed notebook's outputs."""
    nb = nbformat.read(str(path), as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    return losses(text)


def losses(text: str) -> dict[tuple[int, int], str]:
    """(rank, step) -> loss, as printed (repr: every bit of the float)."""
    return {(int(r), int(s)): v for r, s, v in LOSS.findall(text)}


def run_clean(procs_args: list[list[str]], cwd: Path, env: dict, timeout_s: float = 300) -> list[tuple[int, str]]:
    """Start each command at once, wait for all; (exit code, stdout+stderr) each. Whatever is left is ended by PID."""
    procs = [subprocess.Popen(a, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for a in procs_args]
    out = []
    try:
        deadline = time.monotonic() + timeout_s
        for p in procs:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, text))
    finally:
        for p in procs:
            end_tree(p)
    return out


def torchrun(*args: str) -> list[str]:
    """This interpreter's torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", *args]


def script_env() -> dict:
    """The environment for the exported script's ranks: this checkout's ddp_lib, one thread per rank like the notebook's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
    return env
