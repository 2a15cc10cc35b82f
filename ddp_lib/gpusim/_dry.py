"""Dry mode (`DDP_GPU_SIM_DRY=1`): a lesson at its real sizes, with no data behind the large simulated tensors.

A simulated CUDA tensor over `threshold` bytes (1 MiB; `DDP_GPU_SIM_DRY_BYTES`) holds a meta tensor: its shape,
strides and storage size are real, so per-GPU memory is counted exactly (`_memory`) and `OutOfMemoryError` is
raised past the card, but nothing is computed for it. An op with a meta input runs on meta kernels (its small real
inputs taken as meta too); a result at or under the threshold comes back as a real placeholder, zeros (True for
booleans), so values read on the host (`.item()`, printing, `.cpu()`, a host storage's `copy_` of a dry one) read as
0 and comparisons of dry tensors (`==`, `allclose`, `equal`) read True: differences are 0, ranks agree. Small tensors
compute as usual from there, but a matrix product of small ones whose result is large (`large_product`) runs on meta
kernels too. Collectives still meet on every rank in order (their meta tensors replaced by one-element stand-ins), so
hangs and desyncs stay real; they move nothing.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from ddp_lib.gpusim import DRY_ENV as ENV

BYTES_ENV = "DDP_GPU_SIM_DRY_BYTES"
enabled = False
threshold = 2**20


def activate() -> None:
    """Turn dry mode on in this process when $DDP_GPU_SIM_DRY is 1 (called by `ddp_lib.gpusim.activate`)."""
    global enabled, threshold
    enabled = os.environ.get(ENV) == "1"
    threshold = int(os.environ.get(BYTES_ENV) or 2**20)
    if enabled and not hasattr(torch.UntypedStorage.copy_, "__wrapped__"):
        torch.UntypedStorage.copy_ = _copy_from_dry(torch.UntypedStorage.copy_)


def _copy_from_dry(copy_):
    """`UntypedStorage.copy_` that takes a dry (meta) storage as its source: the destination is the placeholder,
    zeros, as a `.cpu()` of a dry tensor reads. torch.distributed.checkpoint's async stager copies each tensor's storage
    into host memory this way (`_state_dict_stager._stage_untyped_storage`); its pages are written, as a box's
    staging copy is resident."""
    @functools.wraps(copy_)
    def copy(self, source, non_blocking=None):
        if source.device.type != "meta" or self.device.type == "meta":
            return copy_(self, source, non_blocking)
        if self.nbytes() != source.nbytes():  # torch's own check, which the meta source would otherwise reach
            raise RuntimeError(f"size does not match, self was {self.nbytes()} bytes but src was {source.nbytes()} "
                               "bytes")
        self.fill_(0)
        return self
    return copy


def is_meta(t) -> bool:
    """Whether `t` is a tensor with no data (meta)."""
    return isinstance(t, torch.Tensor) and t.is_meta


def big(t: torch.Tensor) -> bool:
    """Whether `t`'s storage is over the threshold (held as meta in dry mode)."""
    return t.untyped_storage().nbytes() > threshold


def as_meta(t: torch.Tensor) -> torch.Tensor:
    """`t`'s shape, strides and storage size on the meta device, with no data."""
    if t.is_meta:
        return t
    storage = torch.UntypedStorage(t.untyped_storage().nbytes(), device="meta")
    return torch.empty(0, dtype=t.dtype, device="meta").set_(storage, t.storage_offset(), t.size(), t.stride())


def zeros(t: torch.Tensor) -> torch.Tensor:
    """A host tensor of `t`'s shape and dtype holding the placeholder: zeros, their pages untouched until written
    (calloc's: a large `.cpu()` of a dry tensor costs no resident memory until it is read); True for booleans."""
    n = max(t.numel(), 1) * t.element_size()
    if t.dtype is torch.bool:  # booleans read True: "do the ranks agree" passes, as differences read 0
        return torch.ones(t.shape, dtype=torch.bool)
    flat = torch.from_numpy(np.zeros(n, dtype=np.uint8)).view(t.dtype)[: t.numel()]
    return flat.reshape(t.shape)


_EMPTY: set = set()  # the aten ops that allocate without writing: their host results from a dry tensor


def host(func, out):
    """A host result of `func` run on a dry tensor's meta stand-in: an uninitialised one (`new_empty`, `empty_like`:
    torch.distributed.checkpoint's stager allocates the host copy of a tensor without data so) is the placeholder,
    zeros whose pages stay untouched until written, as `.cpu()` gives; any other comes as computed."""
    if not _EMPTY:
        _EMPTY.update({torch.ops.aten.new_empty.default, torch.ops.aten.empty_like.default})
    if func in _EMPTY and isinstance(out, torch.Tensor) and not out.is_meta and out.is_contiguous():
        return zeros(out)
    return out


def settle(t):
    """An op's result in dry mode: a meta result at or under the threshold becomes real zeros; larger stays meta."""
    if is_meta(t) and not big(t):
        return zeros(t)
    return t


def host_value(func, args):
    """The placeholder for an op that hands a Python value to the host from a meta tensor (`.item()`, `allclose`,
    `equal`, `is_nonzero`): 0 or 0.0, and True for a boolean; NotImplemented for an op that returns tensors."""
    rets = func._schema.returns
    kind = str(rets[0].type) if len(rets) == 1 else ""
    if kind == "Scalar":  # .item(): the tensor's own kind
        dtype = args[0].dtype
        return True if dtype is torch.bool else (0.0 if dtype.is_floating_point or dtype.is_complex else 0)
    return {"bool": True, "float": 0.0, "int": 0}.get(kind, NotImplemented)


def run(func, args: list, kwargs: dict, originals: dict):
    """Run `func` on meta kernels: every tensor argument taken as meta; returns the results and a map from the
    meta stand-in of each real argument to that argument (an in-place op returns its own argument)."""
    def meta(a):
        if isinstance(a, torch.Tensor):
            if a.is_meta:
                return a
            m = as_meta(a)
            originals[id(m)] = a
            return m
        if type(a) is list or type(a) is tuple:  # noqa: E721
            return type(a)(meta(x) for x in a)
        return a
    kwargs = {k: meta(v) for k, v in kwargs.items() if k != "generator"}
    return func(*[meta(a) for a in args], **kwargs)


_PRODUCTS: dict = {}  # aten matrix product -> the positions of its two factors


def large_product(func, args: list) -> bool:
    """Whether `func` is a matrix product whose result is over the threshold although its factors are small real
    tensors (a weight's gradient from a small batch: [out, b] @ [b, in]): it then runs on meta kernels like an op with
    a meta input, rather than computing the large result on the CPU."""
    if not _PRODUCTS:
        aten = torch.ops.aten
        _PRODUCTS.update({aten.mm.default: (0, 1), aten.bmm.default: (0, 1), aten.addmm.default: (1, 2),
                          aten.baddbmm.default: (1, 2)})
    where = _PRODUCTS.get(func)
    if where is None:
        return False
    a, b = args[where[0]], args[where[1]]
    return a.shape[:-1].numel() * b.shape[-1] * a.element_size() > threshold


def any_meta(args) -> bool:
    """Whether any tensor in `args` (lists included) is meta."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_meta:
                return True
        elif (type(a) is list or type(a) is tuple) and any_meta(a):  # noqa: E721
            return True
    return False


def standin(t: torch.Tensor, numel: int = 1) -> torch.Tensor:
    """What a collective carries for a meta tensor: `numel` zeros of its dtype (every rank meets, nothing moves)."""
    return torch.zeros(numel, dtype=t.dtype)
