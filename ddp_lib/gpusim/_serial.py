"""Pickling and `torch.load` of simulated CUDA tensors, as on a box.

A CUDA tensor pickles with the device it was on (`torch.save`, `broadcast_object_list`) and unpickles onto that
device unless `torch.load`'s `map_location` says otherwise; a device this box lacks raises as torch does
(`SimCudaTensor.__reduce_ex__` and `rebuild`, in `_tensor`). CPU tensors loaded with a CUDA `map_location` land on
that GPU.
"""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_map

from ddp_lib.gpusim._tensor import SimCudaTensor, _tls, rebuild, to_device


def _patched_load(original):
    @functools.wraps(original)
    def load(f, map_location=None, *args, **kwargs):
        if isinstance(map_location, torch.device):
            map_location = str(map_location)
        previous, _tls.map_location = getattr(_tls, "map_location", None), map_location
        try:
            # the CPU storages in the file load on the CPU; the simulated ones map in `rebuild`, the others below
            result = original(f, "cpu", *args, **kwargs)
        finally:
            _tls.map_location = previous
        target = None
        if isinstance(map_location, str):
            target = torch.device(map_location)
        elif isinstance(map_location, dict) and "cpu" in map_location:
            target = torch.device(map_location["cpu"])
        if target is None or target.type != "cuda":
            return result
        return tree_map(lambda t: to_device(t, target) if isinstance(t, torch.Tensor)
                        and not isinstance(t, SimCudaTensor) else t, result)
    return load


def install() -> None:
    """Route torch.load through the map_location rules above; let weights_only loads rebuild simulated tensors."""
    torch.serialization.add_safe_globals([rebuild])
    if not getattr(torch.load, "_ddp_gpusim", False):
        torch.load = _patched_load(torch.load)
        torch.load._ddp_gpusim = True
