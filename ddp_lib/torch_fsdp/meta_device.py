"""FSDP that never materialises the model: build it on the meta device, `fully_shard` it, allocate only the shards
(`to_empty`) and initialise them with an init whose result does not depend on how the rows are sharded.

Why not `reset_parameters()` on the shards: it draws from this rank's generator, so with one seed every rank draws
the same first numbers for its own rows, and the gathered model is not the one a full init gives. On GPUs
DTensor's `OffsetBasedRNGTracker` offsets each shard's Philox counter, so the shards draw different,
non-overlapping parts of one stream (`_set_pre_op_offset`), which need not equal a full init's values; on CPU it
refuses to start (`torch/distributed/tensor/_random.py`). `seeded_init_` states its own contract:
row `i` of parameter `name` is drawn from a generator seeded by `(seed, name, i)`, so one process initialising
the full model and N ranks initialising their rows get the same parameters, for any N.

The course's own `FSDP` cannot take a meta module: its construction broadcasts rank 0's materialised weights and
cuts the shards from them (`ddp_lib/fsdp/fully_sharded.py`, `Unit` in `ddp_lib/fsdp/unit_group.py`).
"""

from __future__ import annotations

import math
import zlib
from typing import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ddp_lib.compat import dtensor

DTensor, Shard, compute_local_shape_and_global_offset = dtensor()  # torch 2.5+ names, or 2.4's ._tensor


def local_rows(p: torch.Tensor) -> tuple[int, int]:
    """The global rows [start, stop) of dim 0 this rank holds: all of a plain tensor, its `Shard(0)` of a DTensor."""
    if not isinstance(p, DTensor):
        return 0, p.shape[0]
    if any(isinstance(pl, Shard) and pl.dim != 0 for pl in p.placements):
        raise ValueError(f"seeded_init_: sharded on {p.placements}; only Shard(0) (fully_shard's default) is supported")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0], offset[0] + shape[0]


def row_seed(seed: int, name: str, row: int) -> int:
    """The seed of row `row` of parameter `name`: the same on every rank and at every world size."""
    return zlib.crc32(f"{seed}/{name}/{row}".encode())


@torch.no_grad()
def seeded_init_(module: nn.Module, seed: int) -> nn.Module:
    """Initialise every parameter this rank holds, row by row: a matrix's row i is U(-b, b), b = 1/sqrt(fan_in)
    (nn.Linear's bound), from `torch.Generator().manual_seed(row_seed(seed, name, i))`; 1-D `*bias` zeros,
    other 1-D parameters ones. Names are the module's own (call it on the root). Full or sharded: same values."""
    for name, p in module.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if p.dim() < 2:
            local.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        start, stop = local_rows(p)
        bound = 1.0 / math.sqrt(math.prod(p.shape[1:]))
        rows = torch.empty(stop - start, *p.shape[1:], dtype=local.dtype, device="cpu")  # CPU generators draw here; copied to the device below
        for i in range(start, stop):
            g = torch.Generator().manual_seed(row_seed(seed, name, i))
            rows[i - start].uniform_(-bound, bound, generator=g)
        local.copy_(rows)
    return module


def storage_of(t: torch.Tensor) -> int:
    """The address of the storage a tensor (a DTensor: its local part) lives in."""
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor any op produced while active (bytes of its storage; a DTensor's local part),
    and the storages that ops wrote into in place (`written`: an allocation nobody wrote holds no values)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op, self.written = 0, "", set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for arg, value in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in
                                                                     func._schema.arguments[len(args):]]):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                if value.device.type != "meta":
                    self.written.add(storage_of(value))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                local = t._local_tensor if isinstance(t, DTensor) else t
                n = local.untyped_storage().nbytes()
                if n > self.largest:
                    self.largest, self.op = n, str(func)
        return out


def sharded_on_meta(make_model: Callable[[], nn.Module], mesh, seed: int, block_types: tuple[type, ...] = (nn.Linear,),
                    **fsdp_kwargs) -> nn.Module:
    """`make_model()` built on the meta device, `fully_shard` on each `block_types` module and the root (modules that
    share a tied weight as one group, `ddp_lib.torch_fsdp.tied`), only the shards allocated on the mesh's device, then
    `seeded_init_`: no rank ever holds a full parameter."""
    from ddp_lib.torch_fsdp.tied import shard_grouped

    with torch.device("meta"):
        model = make_model()
    shard_grouped(model, mesh, block_types, **fsdp_kwargs)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    model.to_empty(device=device)
    return seeded_init_(model, seed)
