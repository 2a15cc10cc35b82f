"""The ops a simulated CUDA tensor handles apart from the generic unwrap-run-rewrap of `SimCudaTensor`: copies that
cross devices, in-place shape changes (view ops, resize_, set_), collectives reaching the dispatcher, random draws.

They work on the CPU tensors inside (`_inner`) and return their own arguments, so this module sits below
`_tensor`, which imports it; `.to(...)` makes a new simulated tensor and lives there (`_tensor._to_copy`).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ddp_lib.gpusim import _rng

aten = torch.ops.aten


def _unwrap(a):
    """The CPU tensor inside a simulated one (its `_inner`); anything else as it is."""
    return getattr(a, "_inner", a) if isinstance(a, torch.Tensor) else a


def random_op(func, args: list, kwargs: dict, index: int):
    """A random op on GPU `index`: drawn from that GPU's (seed, offset) unless a generator is given (_rng)."""
    takes_generator = _rng.kind(func)[1]
    if takes_generator and kwargs.get("generator") is not None:
        return func(*args, **kwargs)
    gen = _rng.generator(index)
    if takes_generator:
        out = func(*args, **dict(kwargs, generator=gen))
    else:  # native_dropout and the like draw from the default generator: lend it the GPU's state for this op
        saved = torch.default_generator.get_state()
        torch.default_generator.set_state(gen.get_state())
        try:
            out = func(*args, **kwargs)
        finally:
            torch.default_generator.set_state(saved)
    first = out[0] if isinstance(out, (tuple, list)) else out
    _rng.advance(index, first.numel() if isinstance(first, torch.Tensor) else 0)
    return out


def _copy(func, args, kwargs):
    # copies may cross devices (host to device, device to device), as cudaMemcpy does
    dst, src = args[0], args[1]
    inner_dst, inner_src = _unwrap(dst), _unwrap(src)
    if inner_src.is_meta and not inner_dst.is_meta:  # dry mode (_dry): a copy of no data reads as zeros
        inner_dst.zero_()
    elif not (inner_dst.is_meta and not inner_src.is_meta):  # into a dry tensor nothing is copied
        func(inner_dst, inner_src, *args[2:], **kwargs)
    return dst


def collective(func, args, kwargs):
    # torch.distributed's Python functions and torch DDP's reducer call the simulated group's Python methods
    # (ddp_lib.gpusim._nccl); the functional collectives are carried by ddp_lib.gpusim._funcol; any other c10d op
    # reaching the dispatcher came from C++ code that bypasses both
    from ddp_lib.gpusim._funcol import IMPLS

    impl = IMPLS.get(func)
    if impl is None and str(func).startswith("_c10d_functional._wrap_tensor_autograd"):
        return args[0].clone()  # marks an async result for autograd; the simulated collectives are done already
    if impl is None:
        raise RuntimeError(f"not simulated: {func} called on simulated CUDA tensors from C++ (ddp_lib.gpusim "
                           "carries collectives through the process group's Python methods)")
    return impl(*args, **kwargs)


def _inplace_view(func, args, kwargs):
    # t_, unsqueeze_, transpose_, as_strided_, ...: the inner tensor changes its shape; the wrapper's own metadata
    # is changed to match by running the op on it with meta kernels, as torch.utils._python_dispatch's
    # return_and_correct_aliasing does for wrapper subclasses
    func(*[_unwrap(a) for a in args], **kwargs)
    return _inplace_view_meta(func, args, kwargs)


def _inplace_view_meta(func, args, kwargs):
    """Run the in-place view op `func` on the wrapper itself with meta kernels: its sizes and strides change."""
    from torch.utils._mode_utils import no_dispatch

    with no_dispatch():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)
    return args[0]


def _set_or_resize(func, args, kwargs):
    # set_ may give the inner tensor a shape and storage the wrapper cannot take: that is refused loudly rather than
    # leaving a wrapper whose shape is not its data's (torch.Tensor.__deepcopy__'s new_empty([]).set_(storage, ...)
    # gave 0-dim copies silently). resize_ (scatter_object_list grows its CUDA tensors: distributed_c10d.py,
    # `tensor.resize_(max_tensor_size)`) reshapes the wrapper with its data, as a CUDA tensor's storage grows.
    dst = args[0]
    flat, spec = tree_flatten((args, kwargs))
    inner_args, inner_kwargs = tree_unflatten([_unwrap(a) for a in flat], spec)
    inner = dst._inner
    before = (inner.size(), inner.stride(), inner.storage_offset())
    func(*inner_args, **inner_kwargs)
    after = (inner.size(), inner.stride(), inner.storage_offset())
    if after != (dst.size(), dst.stride(), dst.storage_offset()) and func.__name__.startswith("resize"):
        from ddp_lib.gpusim import _guard

        own = torch.Tensor.untyped_storage(dst)  # the wrapper's: its bounds are checked by as_strided_
        _guard.set_storage_nbytes(own, max(own.nbytes(), inner.untyped_storage().nbytes()))
        _inplace_view_meta(aten.as_strided_.default, (dst, list(after[0]), list(after[1]), after[2]), {})
        return dst
    if after != (dst.size(), dst.stride(), dst.storage_offset()):
        inner.as_strided_(*before)  # the CPU data keeps the wrapper's shape
        raise RuntimeError(f"not simulated: {func} changing the shape of a simulated CUDA tensor in place (from "
                           f"{tuple(dst.size())} to {tuple(after[0])}); create a new tensor instead")
    return dst



SPECIAL = {
    aten.copy_.default: _copy,
    aten._copy_from.default: _copy,
}
for _name in ("set_", "resize_", "resize_as_"):
    for _overload in getattr(aten, _name).overloads():
        SPECIAL[getattr(getattr(aten, _name), _overload)] = _set_or_resize
# every registered aten op (dir(aten) lists only the ones already looked up): squeeze_, unsqueeze_, t_, transpose_,
# swapdims_, as_strided_, detach_, ...
for _name in sorted({n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
                     if n.startswith("aten::")}):
    if _name.endswith("_") and _name not in ("set_", "resize_", "resize_as_"):
        _packet = getattr(aten, _name)
        for _overload in _packet.overloads():
            _op = getattr(_packet, _overload)
            if torch.Tag.inplace_view in _op.tags:
                SPECIAL[_op] = _inplace_view
