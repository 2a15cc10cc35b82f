"""Pickling and `torch.load` of simulated CUDA tensors, as on a box.

A CUDA tensor pickles with the device it was on (`torch.save`, `broadcast_object_list`) and unpickles onto that
device unless `torch.load`'s `map_location` says otherwise; a device this box lacks raises as torch does. CPU
tensors loaded with a CUDA `map_location` land on that GPU.
"""

from __future__ import annotations

import functools
import threading

import torch
from torch.utils._pytree import tree_map

from ddp_lib.gpusim import _cuda
from ddp_lib.gpusim._tensor import SimCudaTensor, to_device

_tls = threading.local()


def _mapped(saved: str):
    """Where a tensor saved on `saved` goes under the active torch.load's map_location (None: no load active)."""
    loc = getattr(_tls, "map_location", None)
    if loc is None:
        return torch.device(saved)
    if isinstance(loc, dict):
        return torch.device(loc.get(saved, saved))
    if callable(loc):
        res = loc(torch.UntypedStorage(0), saved)
        return torch.device(saved) if res is None else torch.device("cpu")
    return torch.device(loc)


def rebuild(inner: torch.Tensor, device: str, requires_grad: bool) -> torch.Tensor:
    """Unpickle a simulated CUDA tensor onto its device (or where map_location sends it)."""
    target = _mapped(device)
    if target.type == "cuda" and target.index is not None and target.index >= _cuda.profile.count:
        raise RuntimeError(f"Attempting to deserialize object on CUDA device {target.index} but "
                           f"torch.cuda.device_count() is {_cuda.profile.count}. Please use torch.load with "
                           "map_location to map your storages to an existing device.")
    out = to_device(inner, target)
    return out.requires_grad_(requires_grad) if requires_grad else out


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
