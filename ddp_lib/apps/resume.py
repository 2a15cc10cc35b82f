"""A resumable training checkpoint for several ranks: what a preempted cloud job needs to go on bit for bit.

Replicated state (the model under DDP, a plain optimizer, the scheduler, the step, every rank's RNG state) is
written once, by rank 0. Sharded state is written by every rank into its own file: a ZeRO-1 optimizer's shard
(`ShardedOptimizer.state_dict()` holds this rank's part only) and an FSDP engine's weights (`save_sharded`)
with the optimizer state over those shards. Every rank reads what it needs, mapped onto its own device.

One commit point: rank 0's atomic rename of `state.pt`. Each save puts its sharded files in a folder of its own
(`step<step>-<token>/`), which `state.pt` names, so a job killed mid-save leaves the previous `state.pt` and the
shards it names intact, never a mix of two steps; the folders of older saves are removed once the new one is
committed.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_lib import comm
from ddp_lib.devices import comm_device

STATE_FILE = "state.pt"
_SHARDS = re.compile(r"step\d{8}-[0-9a-f]{8}")  # a save's shard folder: its step and rank 0's random token


def _rank_file(directory: Path, rank: int, world_size: int) -> Path:
    return directory / f"rank{rank:05d}-of-{world_size:05d}.pt"


def _rng_state() -> dict[str, Any]:
    """This rank's random streams: torch's CPU one, its own GPU's (when it computes on one) and Python's `random`.

    Only the rank's own device: every GPU's stream would create a context on each GPU of the node, and GPUs that
    gloo ranks never use have nothing to resume."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    device = comm_device()
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    device = comm_device()
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _sharded_optimizer(optimizer: torch.optim.Optimizer, engine: Any) -> bool:
    """Whether each rank holds different optimizer state: ZeRO-1's shard, or state over FSDP's weight shards."""
    from ddp_lib.zero import ShardedOptimizer

    return isinstance(optimizer, ShardedOptimizer) or hasattr(engine, "save_sharded")


def save_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, engine: Any,
                    optimizer: torch.optim.Optimizer, scheduler: Any, step: int, extra: dict | None = None) -> Path:
    """Write a resumable checkpoint of `step` optimizer steps into `directory` (a collective: every rank calls it).

    Rank 0 writes the replicated state; with sharded state every rank also writes its own file. The
    barriers make the folder complete before any rank returns (and so before anyone may read it).
    """
    directory = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] = [None] * world
    token = os.urandom(4).hex() if rank == 0 else None  # rank 0's name for this save's shard folder
    comm.all_gather_object(gathered, (_rng_state(), token))  # every rank's streams, so each resumes its own
    rngs = [rng for rng, _ in gathered]
    sharded_model, sharded_optim = hasattr(engine, "save_sharded"), _sharded_optimizer(optimizer, engine)
    shards = f"step{step:08d}-{gathered[0][1]}" if sharded_model or sharded_optim else None
    if rank == 0:
        (directory / shards if shards else directory).mkdir(parents=True, exist_ok=True)
    comm.barrier()
    if sharded_model:
        engine.save_sharded(directory / shards / "model")  # one file per rank, its own shards
    if sharded_optim:
        torch.save({"optimizer": optimizer.state_dict()}, _rank_file(directory / shards, rank, world))
    comm.barrier()  # every shard is on disk before state.pt names them
    if rank == 0:
        state = {"step": step, "world_size": world, "rng": rngs, "scheduler": scheduler.state_dict(),
                 "model": None if sharded_model else model.state_dict(),
                 "optimizer": None if sharded_optim else optimizer.state_dict(), "shards": shards, **(extra or {})}
        tmp = directory / f"{STATE_FILE}.tmp"
        torch.save(state, tmp)
        tmp.replace(directory / STATE_FILE)  # the commit: a job killed before it resumes from the previous save
        for old in directory.iterdir():  # earlier saves' shards: no state.pt names them any more
            if old.is_dir() and _SHARDS.fullmatch(old.name) and old.name != shards:
                shutil.rmtree(old, ignore_errors=True)
    comm.barrier()
    return directory


def load_checkpoint(directory: str | os.PathLike, model: torch.nn.Module, engine: Any,
                    optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Restore what `save_checkpoint` wrote into freshly built objects on every rank; returns the saved state
    (its "step" says where to go on). Call it after the engine and optimizer are built, before training."""
    directory = Path(directory)
    rank, world = dist.get_rank(), dist.get_world_size()
    # on the CPU: RNG states must stay CPU tensors; load_state_dict copies the rest onto each parameter's device
    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=False)
    if state["world_size"] != world:
        raise ValueError(f"{directory} was written by {state['world_size']} ranks; this job has {world}: resume "
                         f"with the same number of ranks (sharded state is split by rank)")
    shards = directory / state["shards"] if state.get("shards") else directory  # the folder this state.pt names
    if state["model"] is not None:
        model.load_state_dict(state["model"])
    else:
        engine.load_sharded(shards / "model")
    if state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    else:
        own = torch.load(_rank_file(shards, rank, world), map_location="cpu", weights_only=False)
        optimizer.load_state_dict(own["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"][rank])
    return state
