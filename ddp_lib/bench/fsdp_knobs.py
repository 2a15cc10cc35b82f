"""Lesson 08's knobs of torch's `fully_shard`, measured on one step each: `reshard_after_forward` (True, False, an
int), explicit forward prefetch, activation checkpointing, and `set_requires_gradient_sync(False)` for
accumulation. Memory is counted by a dispatch mode (CPU ranks have no allocator statistics; on GPUs
`torch.cuda.max_memory_allocated` is reported beside it); communication by the c10d ops each rank issued."""

from __future__ import annotations

import statistics
import time
import weakref
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from ddp_lib import comm
from ddp_lib.compat import dtensor, fsdp2
from ddp_lib.kit.data import shard_batch

DTensor, _, _ = dtensor()  # torch.distributed.tensor (2.5+) or ._tensor (2.4)

COLLECTIVES = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter", "allreduce_": "all_reduce"}
# where each op's schema puts the full-size tensor (the all-gather's output, the reduce-scatter's input, the
# all-reduce's tensors) and its process group: the reduce-scatter's output is only this rank's shard
PAYLOAD_ARG = {"all_gather": 0, "reduce_scatter": 1, "all_reduce": 0}
GROUP_ARG = {"all_gather": 2, "reduce_scatter": 2, "all_reduce": 1}


def payload_bytes(kind: str, args: tuple) -> int:
    """Bytes of the full-size tensor(s) of one c10d collective, from its dispatch arguments."""
    buf = args[PAYLOAD_ARG[kind]]
    return sum(t.numel() * t.element_size() for t in (buf if isinstance(buf, (list, tuple)) else [buf]))


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops produced and that are still alive (storage sizes read live: FSDP frees an
    unsharded parameter by resizing its storage to 0), their peak, and the c10d collectives issued."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, weakref.ref] = {}
        self.peak = 0
        self.calls: list[tuple[str, int, int]] = []  # (kind, full-size payload bytes, group size)

    def now(self) -> int:
        """Bytes alive now among the storages seen."""
        # a snapshot: a storage freed on another thread (autograd's, FSDP's post-backward) runs its finalizer, which
        # pops its entry, while this sums (CI once saw "dictionary changed size during iteration" here)
        return sum(s.nbytes() for s in (r() for r in list(self._live.values())) if s is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = COLLECTIVES.get(func.__name__.split(".")[0]) if func.namespace == "c10d" else None
        if kind is not None:
            group = dist.ProcessGroup.unbox(args[GROUP_ARG[kind]])
            self.calls.append((kind, payload_bytes(kind, args), group.size()))
        for t in tree_leaves((out, args)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
                if id(s) not in self._live:
                    self._live[id(s)] = weakref.ref(s)
                    weakref.finalize(s, self._live.pop, id(s), None)
        self.peak = max(self.peak, self.now())
        return out


def tiny_lm() -> nn.Module:
    """The lesson's `TransformerLM("tiny")`, seeded (fully_shard does not broadcast: every rank builds the same)."""
    from ddp_lib.kit.models import TransformerLM

    torch.manual_seed(0)
    return TransformerLM("tiny")


def lm_blocks(model: nn.Module) -> list[nn.Module]:
    """A `TransformerLM`'s blocks: the modules `fully_shard` gets before the root."""
    return list(model.blocks)


def _checkpointed(block: nn.Module) -> None:
    """Activation checkpointing: the block keeps only its input; backward runs its forward again."""
    inner = block.forward
    block.forward = lambda *a, **k: checkpoint(inner, *a, use_reentrant=False, **k)


def build(make_model: Callable[[], nn.Module], blocks: Callable[[nn.Module], list], reshard=True,
          prefetch: int = 0, ac: bool = False) -> nn.Module:
    """`make_model()` with `fully_shard(reshard_after_forward=reshard)` on each block, then the root; optionally each
    block prefetching the next `prefetch` blocks' all-gathers in forward, and activation checkpointing."""
    fully_shard, _ = fsdp2()
    model = make_model()
    mesh = init_device_mesh("cuda" if next(model.parameters()).is_cuda else "cpu", (dist.get_world_size(),))
    for b in blocks(model):
        if ac:
            _checkpointed(b)
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    if prefetch:
        bs = blocks(model)
        for i, b in enumerate(bs):
            b.set_modules_to_forward_prefetch(bs[i + 1:i + 1 + prefetch])
    return model


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a language model on `tokens` [batch, seq + 1]."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def measure(model: nn.Module, tokens: torch.Tensor, steps: int = 3) -> dict:
    """Host time per step (median of `steps`, the first a warm-up), then one step under `LiveBytes`: bytes alive
    at the end of forward and at the peak (what the step allocated, on top of what existed before) and the
    collectives it issued."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    mine = shard_batch(tokens, rank, ws)
    times = []
    for i in range(steps):
        comm.barrier()
        t0 = time.perf_counter()
        lm_loss(model, mine).backward()
        if mine.is_cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
        model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        loss = lm_loss(model, mine)
        after_forward = live.now()
        loss.backward()
    model.zero_grad(set_to_none=True)
    calls = live.calls
    return {"forward_bytes": after_forward, "peak_bytes": live.peak, "ms": statistics.median(times[1:]),
            "ms_spread": (min(times[1:]), max(times[1:])),
            "all_gathers": sum(k == "all_gather" for k, _, _ in calls),
            "gathered_bytes": sum(b for k, b, _ in calls if k == "all_gather"),
            "gather_groups": sorted({n for k, _, n in calls if k == "all_gather"}),
            "reduce_scatters": sum(k == "reduce_scatter" for k, _, _ in calls),
            "reduced_bytes": sum(b for k, b, _ in calls if k == "reduce_scatter"), "calls": calls}


def link_ms(calls: list[tuple[str, int, int]], alpha_us: float, bandwidth_GBps: float) -> float:
    """Modelled time on a stated link of the collectives `measure` counted, a ring over each call's n ranks: an
    all-gather or a reduce-scatter α + (n−1)/n · bytes / β, an all-reduce (both in turn) α + 2(n−1)/n · bytes / β."""
    return 1e3 * sum(alpha_us * 1e-6 + (2 if k == "all_reduce" else 1) * (n - 1) / n * b / (bandwidth_GBps * 1e9)
                     for k, b, n in calls)


def knobs(make_model: Callable[[], nn.Module], blocks: Callable[[nn.Module], list], tokens: torch.Tensor,
          steps: int = 3) -> dict:
    """Every setting of the lesson's table on this group (an int `reshard_after_forward` needs >= 4 ranks: a
    non-trivial divisor of the shard group's size), each built, measured and freed in turn; then accumulation."""
    ws = dist.get_world_size()
    settings = {"reshard_after_forward=True": {}, "reshard_after_forward=False": {"reshard": False}}
    if ws >= 4 and ws % 2 == 0:
        settings[f"reshard_after_forward={ws // 2}"] = {"reshard": ws // 2}
    settings["True + prefetch 2 blocks ahead"] = {"prefetch": 2}
    settings["True + activation checkpointing"] = {"ac": True}
    out = {}
    for label, kw in settings.items():
        model = build(make_model, blocks, **kw)
        out[label] = measure(model, tokens, steps)
        del model
    model = build(make_model, blocks)
    mine = shard_batch(tokens, dist.get_rank(), ws)
    with LiveBytes() as live:
        model.set_requires_gradient_sync(False)  # micro-steps: unsharded gradients accumulate, no reduce-scatter
        lm_loss(model, mine).backward()
        quiet = [k for k, _, _ in live.calls]
        model.set_requires_gradient_sync(True)  # the last micro-step reduce-scatters the sum
        lm_loss(model, mine).backward()
    out["accumulation"] = {"reduce_scatters_no_sync": quiet.count("reduce_scatter"),
                           "reduce_scatters_sync": [k for k, _, _ in live.calls].count("reduce_scatter")
                           - quiet.count("reduce_scatter")}
    return out
