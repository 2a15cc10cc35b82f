"""The launch files written beside an exported script: torchrun commands and an sbatch job, edited where marked."""

from __future__ import annotations

from pathlib import Path
from string import Template

from ddp_lib.notebook import _rdzv_probe

TORCHRUN = Template("""\
#!/usr/bin/env bash
# Launch $script with torchrun. Written by ddp_lib.notebook.export; edit only the lines marked EDIT.
set -euo pipefail
cd "$$(dirname "$$0")"
NPROC=$${NPROC:-2}  # EDIT: ranks per node (one per GPU on a GPU node)
if [ "$${1:-one}" = one ]; then
    # one node: torchrun picks a free port for rank 0's store
    exec torchrun --standalone --nproc-per-node "$$NPROC" $script
fi
# several nodes: run this same line on every node (node 0 first or not: they wait for each other)
NNODES=$${NNODES:-2}              # EDIT: how many nodes
RDZV_HOST=$${RDZV_HOST:-node0}    # EDIT: a host every node can reach (the first node's name)
RDZV_PORT=$${RDZV_PORT:-29400}    # EDIT: a free port on that host
JOB_ID=$${JOB_ID:-$stem}          # EDIT: the same id on every node of one job, a new one per job
PYTHON=$${PYTHON:-python}         # EDIT: the Python that has torch (torchrun's)
# a port another program holds makes torchrun wait forever, silently: stop here with the reason instead
"$$PYTHON" - "$$RDZV_HOST" "$$RDZV_PORT" "$${RDZV_PROBE_S:-15}" <<'PROBE'
$probe
PROBE
exec torchrun --nnodes "$$NNODES" --nproc-per-node "$$NPROC" --rdzv-backend c10d \\
    --rdzv-endpoint "$$RDZV_HOST:$$RDZV_PORT" --rdzv-id "$$JOB_ID" $script
""")

SBATCH = Template("""\
#!/bin/bash
# Run $script under SLURM: one task (rank) per GPU, srun starts them, the prologue reads SLURM's variables.
# Written by ddp_lib.notebook.export; edit only the lines marked EDIT.
#SBATCH --job-name=$stem
#SBATCH --nodes=1               # EDIT: nodes
#SBATCH --ntasks-per-node=2     # EDIT: ranks per node: one per GPU
#SBATCH --cpus-per-task=1       # EDIT: CPU cores per rank (its data loading, its OpenMP threads)
$gpus#SBATCH --time=00:30:00         # EDIT: the time limit; past it the job is killed: save checkpoints well before
#SBATCH --requeue               # preempted or requeued, the job starts again and resumes from CKPT_DIR
#SBATCH --open-mode=append      # a requeued run appends to the same log
#SBATCH --output=%x-%j.out
set -euo pipefail
# EDIT: a folder every node mounts (not /tmp): rank 0 writes the checkpoint, all ranks read it back
export CKPT_DIR=$${CKPT_DIR:-$$SLURM_SUBMIT_DIR/checkpoints/$$SLURM_JOB_NAME-$$SLURM_JOB_ID}
# rank 0's store on the allocation's first host, a port of this job's own (the prologue falls back to the same)
export MASTER_ADDR=$${MASTER_ADDR:-$$(scontrol show hostnames "$$SLURM_JOB_NODELIST" | head -n 1)}
export MASTER_PORT=$${MASTER_PORT:-$$((20000 + SLURM_JOB_ID % 10000))}
export OMP_NUM_THREADS=$${SLURM_CPUS_PER_TASK:-1}
# export NCCL_SOCKET_IFNAME=ib0  # EDIT: the interface between nodes, if NCCL picks a wrong one
# export NCCL_DEBUG=INFO         # EDIT: uncomment to read the transport NCCL chose (IB, Socket, P2P/NVLink)
echo "job $$SLURM_JOB_ID restart $${SLURM_RESTART_COUNT:-0} on $$SLURM_JOB_NODELIST, rank 0 at $$MASTER_ADDR:$$MASTER_PORT"
# srun does not inherit --cpus-per-task from sbatch (Slurm 22.05 on): passed on, each bound rank gets its cores
srun --kill-on-bad-exit=1 --cpus-per-task="$${SLURM_CPUS_PER_TASK:-1}" python -u $script
""")


def write_launch_files(script: Path, gpus_per_task: int = 0) -> list[Path]:
    """Write `<stem>.torchrun.sh` and `<stem>.sbatch` beside `script`; returns their paths."""
    probe = Path(_rdzv_probe.__file__).read_text().split("# --- probe: begin ---\n", 1)[1]
    fields = {"script": script.name, "stem": script.stem, "probe": probe.split("# --- probe: end ---", 1)[0].rstrip(),
              "gpus": f"#SBATCH --gpus-per-task={gpus_per_task}  # EDIT: GPUs per rank\n" if gpus_per_task else
              "# #SBATCH --gpus-per-task=1   # EDIT: uncomment on a GPU partition (one GPU per rank)\n"}
    out = []
    for suffix, template in ((".torchrun.sh", TORCHRUN), (".sbatch", SBATCH)):
        path = script.with_name(script.stem + suffix)
        path.write_text(template.substitute(fields))
        path.chmod(0o755)
        out.append(path)
    return out
