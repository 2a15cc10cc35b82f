"""Lesson 08's checker for FSDP built on the meta device: sharded, never a full parameter allocated, and equal to
the seeded full initialisation (`ddp_lib.torch_fsdp.meta_device.seeded_init_`'s contract); with `tied=True`, on a model
whose output projection is its embedding, the tie kept as one parameter in one FSDP group (`ddp_lib.torch_fsdp.tied`)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from ddp_lib.check._runner import CheckResult, Mismatch, Property, learner_namespaces, run_check
from ddp_lib.compat import dtensor
from ddp_lib.devices import comm_device, needs_process_group
from ddp_lib.kit.models import TiedModel, ToyModel
from ddp_lib.torch_fsdp.meta_device import LargestAllocation, local_rows, seeded_init_, storage_of

DTensor, Shard, _ = dtensor()  # torch.distributed.tensor (2.5+) or ._tensor (2.4)


SEED = 7  # not 0: an answer that ignores `seed` shows
#: the largest weight (layers.1, 64 x 64) dwarfs the others, and its rows split evenly at 2 and 4 ranks
MAKE = functools.partial(ToyModel, 16, 64, 8, depth=2)
#: `tied=True`: embed.weight (64 x 16, also out.weight) is the largest, and splits evenly at 2 and 4 ranks
MAKE_TIED = functools.partial(TiedModel, 64, 16)
TIED = "tied weights: one parameter, one FSDP group"


def _run(fn: Callable, cache: dict) -> dict:
    """Call the learner's function once per check (under the allocation guard); later properties reuse it."""
    make = cache["make"]
    if "model" not in cache:
        dev = comm_device()
        mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(dev)
            cache["base"] = torch.cuda.memory_allocated(dev)
        with LargestAllocation() as guard:
            cache["model"] = fn(make, mesh, SEED)
        cache["largest"], cache["op"], cache["written"] = guard.largest, guard.op, guard.written
        if dev.type == "cuda":
            cache["peak"] = torch.cuda.max_memory_allocated(dev) - cache["base"]
    return cache


def _full_sizes(make: Callable[[], nn.Module]) -> dict[str, int]:
    with torch.device("meta"):
        return {n: p.numel() * p.element_size() for n, p in make().named_parameters()}


def _tie_kept(model: nn.Module) -> None:
    """Raise Mismatch, with the error torch's first forward gives, where embed and out no longer share a parameter."""
    if model.embed.weight is model.out.weight:
        return
    said = "(torch accepted a forward)"
    try:  # fully_shard's lazy init refuses before any collective, on every rank alike
        model(torch.zeros(1, 2, dtype=torch.long, device=model.embed.weight.device))
    except ValueError as e:
        said = f"torch's first forward says: {e}"
    raise Mismatch("embed.weight and out.weight are two parameters now: fully_shard on each module apart made two "
                   f"FSDP groups for one tied weight; {said}")


@needs_process_group
def check_meta_init(fn: Callable[[Callable[[], nn.Module], Any, int], nn.Module],
                    timeout_s: float | None = None, tied: bool = False) -> CheckResult:
    """`fn(make_model, mesh, seed)` returns `make_model()`'s model under `fully_shard` on `mesh`, initialised by
    `seeded_init_(model, seed)`'s contract, without any rank allocating a full parameter; `tied=True` gives it a
    model with tied embeddings (`TiedModel`), whose tie must stay one parameter in one FSDP group."""
    m = _MetaInit(fn, tied)
    tied_props = [Property(TIED, m.tie, "fully_shard([model.embed, model.out]) (one group for the tied weight), "
                           "each other Linear, then the root", needs=("sharded, allocated on the device",))]
    return run_check("check_meta_init", [
        Property("sharded, allocated on the device", m.sharded,
                 "with torch.device('meta'): build; fully_shard each Linear and the root; model.to_empty(device=...)"),
        Property("no rank allocated a full parameter", m.no_full,
                 "nothing real before fully_shard: build under torch.device('meta'), to_empty only after sharding",
                 needs=("sharded, allocated on the device",)),
    ] + (tied_props if tied else []) + [
        Property("equal to the seeded full initialisation", m.equal,
                 "seeded_init_(model, seed) after to_empty: each row from its own seeded generator",
                 needs=("sharded, allocated on the device",) + ((TIED,) if tied else ())),
    ], timeout_s, learner_namespaces(fn))


class _MetaInit:
    """The setup (the learner's fn, the model to build, the one run every property reads, cached) and one method
    per property's evidence."""

    def __init__(self, fn: Callable, tied: bool) -> None:
        self.fn = fn
        self.rank, self.ws, self.dev = dist.get_rank(), dist.get_world_size(), comm_device()
        self.make = MAKE_TIED if tied else MAKE
        self.cache: dict = {"make": self.make}

    def sharded(self) -> None:
        model = _run(self.fn, self.cache)["model"]
        for name, p in model.named_parameters():
            if not isinstance(p, DTensor):
                raise Mismatch(f"{name} is a plain {p.device.type} tensor of shape {list(p.shape)}, not a DTensor: "
                               "fully_shard the model (each Linear, then the root) before allocating it")
            local = p.to_local()
            if local.device.type == "meta":
                raise Mismatch(f"{name} is still on the meta device: to_empty(device=...) allocates the shards")
            if local.device.type != self.dev.type or not any(isinstance(pl, Shard) for pl in p.placements):
                raise Mismatch(f"{name}: local shard on {local.device}, placements {p.placements}; "
                               f"expected Shard(0) on {self.dev.type}")

    def no_full(self) -> None:
        c = _run(self.fn, self.cache)
        sizes = _full_sizes(self.make)
        name, full = max(sizes.items(), key=lambda kv: kv[1])
        if self.ws > 1 and c["largest"] >= full:
            raise Mismatch(f"this rank allocated {c['largest']} bytes at once ({c['op']}); the full {name} is "
                           f"{full} bytes: a full parameter existed here. Build on the meta device, fully_shard, "
                           "then to_empty: only shards are ever allocated")
        if self.ws > 1 and "peak" in c and c["peak"] >= sum(sizes.values()):
            raise Mismatch(f"the GPU's peak grew by {c['peak']} bytes, the whole model is {sum(sizes.values())}")

    def equal(self) -> float:
        c = _run(self.fn, self.cache)
        model = c["model"]
        ref = dict(seeded_init_(self.make(), SEED).named_parameters())  # one process, the full model
        ignored = dict(seeded_init_(self.make(), 0).named_parameters())
        worst = 0.0
        for name, p in model.named_parameters():
            local = p.to_local().detach().cpu().float()
            start, stop = local_rows(p)
            want, other = ref[name][start:stop].float(), ignored[name][start:stop].float()
            d = (local - want).abs().max().item() if local.numel() else 0.0
            if d != d or d > 1e-6:
                if torch.equal(local, other) and not torch.equal(want, other):
                    raise Mismatch(f"{name}: rows {start}..{stop - 1} are seed 0's, not seed {SEED}'s: "
                                   "pass `seed` to the init", d)
                if storage_of(p) not in c["written"]:
                    raise Mismatch(f"{name}: rows {start}..{stop - 1} were never written after they were "
                                   "allocated: to_empty allocates memory (whatever it held), it does not "
                                   "initialise it", d)
                raise Mismatch(f"{name}: rows {start}..{stop - 1} are random but not the seeded full "
                               "initialisation's: an init run on a shard draws from this rank's generator (with one "
                               "seed every rank draws the same first numbers), so it is not the full model's init; "
                               "use seeded_init_(model, seed)", d)
            worst = max(worst, d)
        return worst

    def tie(self) -> None:
        _tie_kept(_run(self.fn, self.cache)["model"])
