"""Collective names that moved between torch releases, resolved once for the whole package.

torch 2.13 names the flat-tensor collectives `all_gather_single` / `reduce_scatter_single` and deprecates
`all_gather_into_tensor` / `reduce_scatter_tensor`; the releases the package still supports (torch>=2.4)
only have the older names. The lessons call these two aliases; the package's own code goes through
`ddp_lib.comm` (its `all_gather_into_tensor` / `reduce_scatter_tensor`). Each alias looks the torch function up
when called, so whatever is installed in `torch.distributed` (a checker's guard, a test's spy) sees the call.
"""

from __future__ import annotations

from typing import Any

from ddp_lib.comm import resolve


def all_gather_single(output, input, *args: Any, **kwargs: Any) -> Any:
    """`all_gather_single(output, input, group=None, async_op=False)`: every rank's `input` into one flat `output`."""
    return resolve("all_gather_into_tensor")(output, input, *args, **kwargs)


def reduce_scatter_single(output, input, *args: Any, **kwargs: Any) -> Any:
    """`reduce_scatter_single(output, input, op=SUM, group=None, async_op=False)`: rank r gets the reduced slice r."""
    return resolve("reduce_scatter_tensor")(output, input, *args, **kwargs)


def fsdp2():
    """torch's FSDP2, `(fully_shard, MixedPrecisionPolicy)`: public in `torch.distributed.fsdp` since torch 2.6,
    in `torch.distributed._composable.fsdp` before (2.4 and 2.5). Imported on call: only the FSDP2 comparisons
    and DCP need it."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch 2.4 / 2.5
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def dtensor():
    """`(DTensor, Shard, compute_local_shape_and_global_offset)`: public in `torch.distributed.tensor` since torch
    2.5, in `torch.distributed._tensor` before (2.4). Imported on call: only the FSDP2 code needs them."""
    try:
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor, Shard
        from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
    return DTensor, Shard, compute_local_shape_and_global_offset


def dtensor_api():
    """`(Shard, Replicate, distribute_tensor)`, lesson 08's DTensor primer: public in `torch.distributed.tensor` since
    torch 2.5, in `torch.distributed._tensor` before (2.4)."""
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor
    return Shard, Replicate, distribute_tensor
