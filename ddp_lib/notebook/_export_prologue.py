"""What `%dist_init` did on each rank, redone from a launcher's environment (torchrun's or SLURM's).

The exporter (`ddp_lib.notebook.export`) copies this file's source between the markers into every exported script,
so a script needs torch alone to start its process group; the copy here is what the tests import.
"""

# --- prologue: begin ---
import datetime
import os
import re

if os.environ.get("DDP_GPU_SIM"):  # the course's simulated GPU box (ddp_lib.gpusim) must be installed before torch
    import ddp_lib  # noqa: F401

import torch
import torch.distributed as dist


def expand_nodelist(spec: str) -> list[str]:
    """SLURM's compact host list expanded as `scontrol show hostnames` does: "n[01-03,7],login" -> n01 n02 n03 n7 login.

    Commas split hosts outside brackets only; each bracket holds numbers and ranges whose lower bound's zero padding
    is kept; several bracket groups in one name give every combination, in order."""
    if not spec or not spec.strip():
        raise ValueError("empty SLURM node list")
    hosts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(spec + ","):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"SLURM node list {spec!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM node list {spec!r}: ']' without '['")
        elif ch == "," and depth == 0:
            item = spec[start:i].strip()
            if not item:
                raise ValueError(f"SLURM node list {spec!r}: an empty host name")
            hosts.extend(_expand_one(item, spec))
            start = i + 1
    if depth:
        raise ValueError(f"SLURM node list {spec!r}: '[' without ']'")
    return hosts


def _expand_one(item: str, spec: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if not m:
        return [item]
    numbers = []
    for part in m.group(1).split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"SLURM node list {spec!r}: {part.strip()!r} is not a number or a range a-b")
        if sep and int(hi) < int(lo):
            raise ValueError(f"SLURM node list {spec!r}: range {lo}-{hi} runs backwards")
        numbers.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi if sep else lo) + 1))
    head, tail = item[:m.start()], item[m.end():]
    return [h for n in numbers for h in _expand_one(head + n + tail, spec)]


def _need(env, name: str, launcher: str) -> str:
    value = env.get(name, "")
    if not value:
        raise RuntimeError(f"{name} is not set: this script takes its rank from {launcher}'s environment; run it "
                           "with torchrun (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or srun "
                           "(SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, SLURM_JOB_NODELIST)")
    return value


def launcher_env(env=None) -> dict:
    """Rank, local rank, world size and rank 0's address and port: torchrun's variables, else SLURM's (srun)."""
    env = os.environ if env is None else env
    if "RANK" in env or "SLURM_PROCID" not in env:  # torchrun, or any env:// launcher
        return {"launcher": "torchrun", "rank": int(_need(env, "RANK", "torchrun")),
                "local_rank": int(_need(env, "LOCAL_RANK", "torchrun")),
                "world_size": int(_need(env, "WORLD_SIZE", "torchrun")),
                "master_addr": _need(env, "MASTER_ADDR", "torchrun"), "master_port": _need(env, "MASTER_PORT", "torchrun")}
    nodes = env.get("SLURM_JOB_NODELIST") or _need(env, "SLURM_NODELIST", "srun")
    # rank 0 runs on the allocation's first host; a job's own port, so two jobs sharing a node do not collide
    port = env.get("MASTER_PORT") or str(20000 + int(_need(env, "SLURM_JOB_ID", "srun")) % 10000)
    return {"launcher": "srun", "rank": int(_need(env, "SLURM_PROCID", "srun")),
            "local_rank": int(_need(env, "SLURM_LOCALID", "srun")),
            "world_size": int(_need(env, "SLURM_NTASKS", "srun")),
            "master_addr": env.get("MASTER_ADDR") or expand_nodelist(nodes)[0], "master_port": port}


def pick_device(local_rank: int, cpu_only: bool) -> torch.device:
    """One GPU per rank (the local rank's; the only one when srun --gpus-per-task gave the task one), else the CPU."""
    n = torch.cuda.device_count() if not cpu_only and torch.cuda.is_available() else 0
    if n > local_rank:
        return torch.device("cuda", local_rank)
    if n == 1:
        return torch.device("cuda", 0)
    return torch.device("cpu")


def init_from_launcher(cpu_only: bool = False, timeout_s: float = 1800.0):
    """Join the job's process group as `%dist_init`'s ranks did: NCCL with device_id on a GPU, gloo on the CPU."""
    e = launcher_env()
    # the variables torch's env:// and the course's helpers (ddp_lib.mesh.get("lrank")) read, whoever launched
    os.environ.update(RANK=str(e["rank"]), LOCAL_RANK=str(e["local_rank"]), WORLD_SIZE=str(e["world_size"]),
                      MASTER_ADDR=e["master_addr"], MASTER_PORT=str(e["master_port"]))
    dev = pick_device(e["local_rank"], cpu_only)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method="env://", rank=e["rank"],
                            world_size=e["world_size"], timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": dev} if dev.type == "cuda" else {}))
    # torchrun's agent hosts this job's store; process groups this script starts itself (ddp_lib.launch.spawn in
    # lesson 08) must host their own, as %dist_init's ranks (which have no agent) do: their rank 0 hung otherwise
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return e["rank"], e["world_size"], dev
# --- prologue: end ---
