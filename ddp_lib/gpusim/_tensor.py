"""Simulated CUDA tensors: a wrapper subclass that says `cuda:i` and holds a CPU tensor that does the work.

Every aten op on one reaches `__torch_dispatch__`, which checks the devices as CUDA kernels do (tensors on two
devices raise; a 0-dim CPU tensor may join, as a CUDA kernel takes it as a scalar), runs the op on the inner CPU
tensors and wraps the results on the same device. Copies (`copy_`, `_to_copy`) may cross devices, as on a GPU.
"""

from __future__ import annotations

import copy
import threading

import torch

from ddp_lib.gpusim import _box, _dry, _memory, _rng
from ddp_lib.gpusim._special import SPECIAL, _unwrap, collective as _collective, random_op as _random

aten = torch.ops.aten


def _same_device_error(a: torch.device, b: torch.device) -> RuntimeError:
    # ATen's wording (TensorIterator's compute_types and the device checks of the CUDA kernels' wrappers)
    return RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!")


class SimCudaTensor(torch.Tensor):
    """A tensor on a simulated `cuda:i`; `_inner` is the CPU tensor holding its data."""

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, requires_grad: bool = False):
        """Wrap the CPU tensor `inner` as a tensor on `device` (a cuda device with an index)."""
        return _wrap(inner, device, requires_grad, cls)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: D105
        _box.drain()
        text = repr(_host(self._inner.detach()))
        extra = f", device='{self.device}'"
        if self.requires_grad:
            extra += ", requires_grad=True"
        return text[:-1] + extra + ")" if text.endswith(")") else text + extra

    def __deepcopy__(self, memo):
        """A copy on the same device, with its attributes (a Parameter's flag) and gradient."""
        if id(self) in memo:
            return memo[id(self)]
        new = SimCudaTensor(self._inner.detach().clone(), self.device, requires_grad=self.requires_grad)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key != "_inner":
                setattr(new, key, copy.deepcopy(value, memo))
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        return new

    @property
    def data(self) -> torch.Tensor:
        """torch's own `.data`: the same data, outside autograd."""
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """`t.data = new`: torch's own checks and new shape and device, and `new`'s data behind them. torch's setter
        copies the tensor's metadata only (`shallow_copy_from`); the CPU tensor holding the data is this wrapper's
        own attribute, so it follows here: without it `t` took `new`'s shape over its old data."""
        torch._C.TensorBase.data.__set__(self, new)
        if isinstance(new, SimCudaTensor):
            inner = new._inner.detach()  # its own tensor over the same storage: an in-place view op on one is not
            _memory.track(self, inner, new.device.index)  # on the other (as two CUDA tensors sharing a storage)
            self._inner = inner

    def tolist(self):
        """As on a CUDA tensor: a copy to the host, as Python numbers (Tensor.tolist refuses subclasses)."""
        _box.drain()
        return _host(self._inner).tolist()

    def data_ptr(self) -> int:
        """The address of the data (on the host here)."""
        return self._inner.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        """The inner tensor's storage: identity (data_ptr, views sharing it) as on the GPU; its device is the host."""
        return self._inner.untyped_storage()

    def numpy(self, *, force: bool = False):
        """CUDA tensors do not convert to numpy without a copy to the host (torch's own message)."""
        if force:
            _box.drain()
            return _host(self._inner.detach()).numpy()
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    def __tensor_flatten__(self):
        """torch.compile's view of the subclass: one inner tensor, the device as context."""
        return ["_inner"], (self.device,)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size, outer_stride):  # noqa: ARG004
        """Rebuild from `__tensor_flatten__`'s parts."""
        return SimCudaTensor(inner_tensors["_inner"], ctx[0])

    def __reduce_ex__(self, proto):
        """Pickled as its CPU data and the device it was on: unpickling puts it back there (`rebuild`)."""
        return rebuild, (self._inner.detach(), str(self.device), self.requires_grad)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ARG003
        """Run `func` on the CPU tensors inside, after the device checks CUDA would make."""
        if _box.pending:  # collectives in flight on the stream: this op runs after them
            _box.drain()
        route = _ROUTES.get(func)
        if route is None:
            route = _route(func)
        special, indexing, random = route
        if special is not None:  # copies, in-place shape changes, collectives (_special)
            return special(func, args, kwargs or {})
        # one pass over the arguments (an aten op's are tensors, scalars and lists of them: no pytree needed, which
        # cost a quarter of every op's time) unwraps them and collects their tensors for the device check
        seen: list = []
        if indexing:  # indexing takes CPU index tensors beside a CUDA tensor (copied over), as on a GPU
            inner_args = [_unwrap_all(a, seen if i != 1 else []) for i, a in enumerate(args)]
        else:
            inner_args = [_unwrap_all(a, seen) for a in args]
        inner_kwargs = {k: _unwrap_all(v, seen) for k, v in kwargs.items()} if kwargs else {}
        device = _common_device(seen, func)
        if inner_kwargs.get("device") is not None:  # empty_like(x, device=...), new_zeros(..., device=...)
            device = _resolve(torch.device(inner_kwargs["device"]))
            inner_kwargs["device"] = _CPU
        if _dry.enabled and (_dry.any_meta(inner_args) or _dry.any_meta(inner_kwargs.values())
                             or _dry.large_product(func, inner_args)):
            return _dry_op(func, inner_args, inner_kwargs, seen, device)
        if random and device.type == "cuda":
            out = _random(func, inner_args, inner_kwargs, device.index)
        else:
            out = func(*inner_args, **inner_kwargs)
        if device.type == "cpu":
            return out
        return _rewrap(out, seen, device)


def _dry_op(func, inner_args: list, inner_kwargs: dict, seen: list, device: torch.device):
    """An op with a data-less (meta) input, in dry mode: meta kernels, small results as zeros (_dry)."""
    value = _dry.host_value(func, inner_args)
    if value is not NotImplemented:
        return value
    originals: dict = {}
    out = _dry.run(func, inner_args, inner_kwargs, originals)
    if device.type == "cpu":
        return _dry.host(func, out)

    def back(o):
        if isinstance(o, torch.Tensor) and id(o) in originals:  # in-place on a real argument: that argument
            return originals[id(o)]
        return _dry.settle(o) if isinstance(o, torch.Tensor) else o
    out = type(out)(back(o) for o in out) if isinstance(out, (tuple, list)) else back(out)
    return _rewrap(out, seen, device)


_CPU = torch.device("cpu")
_ROUTES: dict = {}  # aten op -> (its special handler or None, an indexing op, draws random numbers)


def _route(func) -> tuple:
    """How `__torch_dispatch__` handles `func`, worked out once per op (every op asked the same questions before)."""
    special = _SPECIAL.get(func)  # copies, in-place shape changes (ddp_lib.gpusim._special)
    if special is None and func.namespace in ("c10d", "_c10d_functional"):
        special = _collective
    route = _ROUTES[func] = (special, func in _INDEXING, _rng.kind(func)[0])
    return route


def _wrap(inner: torch.Tensor, device: torch.device, requires_grad: bool = False, cls=None) -> "SimCudaTensor":
    """`inner` (CPU) as a simulated tensor on `device`, its storage counted on that GPU."""
    if _dry.enabled and not inner.is_meta and type(inner) is torch.Tensor and _dry.big(inner):
        inner = _dry.as_meta(inner)  # no data behind a large simulated tensor (_dry)
    r = torch.Tensor._make_wrapper_subclass(
        cls or SimCudaTensor, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
        dtype=inner.dtype, layout=inner.layout, device=device, requires_grad=requires_grad)
    r._inner = inner
    _memory.track(r, inner, device.index)
    return r


def _unwrap_all(a, seen: list):
    """`a` with its simulated tensors replaced by their CPU tensors (inside lists too); its tensors go to `seen`."""
    if isinstance(a, torch.Tensor):
        seen.append(a)
        return a._inner if isinstance(a, SimCudaTensor) else a
    if type(a) is list or type(a) is tuple:  # noqa: E721 - exactly these: torch.Size and the like hold no tensors
        return type(a)(_unwrap_all(x, seen) for x in a)
    return a


def _common_device(flat: list, func) -> torch.device:
    device = None
    for a in flat:
        if isinstance(a, SimCudaTensor):
            d = a.device
        elif a.dim() > 0 and a.device.type != "meta":  # a CPU tensor
            d = a.device  # a 0-dim CPU tensor is allowed beside CUDA ones (taken as a scalar)
        else:
            continue
        if device is None:
            device = d
        elif d != device:
            if d.type == "cuda" and device.type != "cuda":
                device, d = d, device
            raise _same_device_error(device, d)
    if device is None or device.type != "cuda":
        raise RuntimeError(f"ddp_lib.gpusim: {func} reached the simulated CUDA dispatch without a CUDA tensor")
    return device


def _rewrap(out, flat: list, device: torch.device):
    if isinstance(out, (tuple, list)):
        return type(out)(_rewrap_one(o, flat, device) for o in out)
    return _rewrap_one(out, flat, device)


def _rewrap_one(o, flat: list, device: torch.device):
    # an op that returns one of its inputs (in-place, out=) returns that input's wrapper, not a new one
    if isinstance(o, torch.Tensor) and not isinstance(o, SimCudaTensor):
        for a in flat:
            if isinstance(a, SimCudaTensor) and a._inner is o:
                return a
        return _wrap(o, device)
    return o


def _resolve(device: torch.device) -> torch.device:
    """A cuda device with its index (the current device where none is given)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", _box.current)
    return device


def to_device(inner: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`inner` (CPU) placed on `device`: itself on the CPU, a simulated tensor on a cuda device."""
    device = _resolve(device)
    if device.type == "cpu":
        return inner
    if device.type != "cuda":
        raise RuntimeError(f"not simulated: tensors on {device} beside simulated CUDA devices")
    _box.check_index(device.index)
    return _wrap(inner, device)


def _host(inner: torch.Tensor) -> torch.Tensor:
    """`inner` as the host reads it: a dry (meta) tensor reads as zeros (_dry)."""
    return _dry.zeros(inner) if inner.is_meta else inner


def _to_copy(func, args, kwargs):
    """`.to(...)`, `.cuda()`, `.cpu()`: the copy made on the CPU, then placed where it was sent (it may cross devices,
    as cudaMemcpy does)."""
    src = args[0]
    device = _resolve(torch.device(kwargs.pop("device", None) or src.device))
    inner = _unwrap(src)
    if _dry.enabled and not inner.is_meta and device.type == "cuda" and _dry.big(inner):
        inner = _dry.as_meta(inner)  # a large host tensor sent to a dry GPU: its data is not copied
    if inner.is_meta:  # dry: no data to copy; the host gets zeros, a GPU a meta copy (zeros where small)
        out = func(inner, **kwargs)
        return _dry.zeros(out) if device.type == "cpu" else to_device(_dry.settle(out), device)
    return to_device(func(inner, **kwargs), device)


_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
_SPECIAL = {**SPECIAL, aten._to_copy.default: _to_copy}  # the ops handled apart from the unwrap-run-rewrap above


# ---------------------------------------------------------------------------------------------------- unpickling
_tls = threading.local()  # map_location: that of the torch.load running on this thread (ddp_lib.gpusim._serial)


def _mapped(saved: str) -> torch.device:
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
    if target.type == "cuda" and target.index is not None and target.index >= _box.profile.count:
        raise RuntimeError(f"Attempting to deserialize object on CUDA device {target.index} but "
                           f"torch.cuda.device_count() is {_box.profile.count}. Please use torch.load with "
                           "map_location to map your storages to an existing device.")
    out = to_device(inner, target)
    return out.requires_grad_(requires_grad) if requires_grad else out
