"""Lesson 08: FSDP (ZeRO-3) from scratch: each layer's weight is sharded, gathered just in time, reduce-scattered."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lib.ddp.base import broadcast_module_state, group_by_kind
from ddp_lib.mesh import require_process_group
from ddp_lib.profiling import phase


class _Unit:
    """One sharded weight: this rank's flat fp32 shard, and the gathered full weight while a module uses it."""

    def __init__(self, name: str, weight: nn.Parameter, rank: int, world_size: int):
        self.name, self.shape, self.numel = name, weight.shape, weight.numel()
        self.padded = math.ceil(self.numel / world_size) * world_size  # so that it splits evenly
        flat = torch.zeros(self.padded, dtype=torch.float32, device=weight.device)
        flat[:self.numel] = weight.detach().reshape(-1)
        size = self.padded // world_size
        self.shard = nn.Parameter(flat[rank * size:(rank + 1) * size].clone(), requires_grad=weight.requires_grad)
        self.buf: torch.Tensor | None = None  # the gathered weight (flat, padded, compute dtype), only while in use
        self.work: dist.Work | None = None  # its all-gather while in flight
        self.src: torch.Tensor | None = None  # the cast shard the all-gather reads
        self.grads: list[tuple[dist.Work, torch.Tensor, torch.Tensor]] = []  # reduce-scatters of this backward

    def full(self) -> torch.Tensor:
        """The gathered weight in its original shape (valid once the all-gather has completed)."""
        return self.buf[:self.numel].view(self.shape)


class _GatherWeight(torch.autograd.Function):
    """Forward: the full weight, all-gathered from the shards. Backward: reduce-scatter its gradient."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, fsdp: "FSDP", unit: _Unit) -> torch.Tensor:
        ctx.fsdp, ctx.unit = fsdp, unit
        return fsdp._wait_gather(unit)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.fsdp._reduce_scatter(ctx.unit, grad)
        return None, None, None  # the shard's .grad is filled by finish_gradient_synchronization()


class FSDP(nn.Module):
    """Fully sharded data parallel: the `weight` of every `shard_types` module lives as 1/world_size flat fp32 shards.

    Forward gathers each weight just before its module runs (prefetching the next one) and frees it after;
    autograd saves a note instead of the full weight, and backward gathers it again when it needs it, then
    reduce-scatters its gradient. Other parameters are replicated and all-reduced, as in DDP. With
    `compute_dtype`, weights are cast before they are gathered and compute runs in that dtype; master shards,
    optimizer and gradient shards stay fp32 (gradients are reduced in fp32). Build the optimizer after wrapping.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 shard_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding), process_group=None):
        super().__init__()
        require_process_group()
        self.module, self.process_group = module, process_group
        self.rank, self.world_size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.dtype, self.cast = compute_dtype or torch.float32, compute_dtype is not None
        sharded = {m: n for n, m in module.named_modules() if isinstance(m, tuple(shard_types))}
        for m, name in sharded.items():  # every check before the first collective, so every rank raises alike
            w = m._parameters.get("weight")
            if not isinstance(w, nn.Parameter) or not w.is_floating_point():
                raise ValueError(f"FSDP: {name or 'the module'} ({type(m).__name__}) is in shard_types but has no "
                                 "floating-point `weight` Parameter to shard; leave its type out of shard_types")
            if getattr(m, "sparse", False) or getattr(m, "max_norm", None) is not None:
                raise ValueError(f"FSDP: {name} is an Embedding with sparse=True or max_norm: its weight "
                                 "cannot be sharded (sparse gradients, in-place renormalisation)")
        weights = {m._parameters["weight"] for m in sharded}
        for name, m in module.named_modules():
            for pname, p in m._parameters.items():
                if p in weights and (m not in sharded or pname != "weight"):
                    raise ValueError(f"FSDP: {f'{name}.{pname}' if name else pname} is a sharded weight that "
                                     f"{type(m).__name__} also holds directly; it would see a shard. Shard both "
                                     "modules or neither")
        broadcast_module_state(module, process_group)  # rank 0's initialisation, then every rank shards the same
        by_weight: dict[nn.Parameter, _Unit] = {}
        self.units: dict[nn.Module, _Unit] = {}  # a tied weight: two modules, one unit
        for m, name in sharded.items():
            w = m._parameters["weight"]
            if w not in by_weight:
                by_weight[w] = _Unit(f"{name}.weight" if name else "weight", w, self.rank, self.world_size)
            self.units[m] = by_weight[w]
            m._parameters["weight"] = by_weight[w].shard  # what parameters(), optimizers and state_dict now see
        shards = {u.shard for u in self.units.values()}
        self.replicated = [p for p in module.parameters() if p.requires_grad and p not in shards]
        for m in module.modules():
            if m in self.units or (self.cast and m._parameters):
                m.register_forward_pre_hook(self._pre_forward)
                m.register_forward_hook(self._post_forward, always_call=True)
        # prefetch plans: the units in the order the last forward used them (first guess: registration
        # order) and the reverse of the order autograd saved them, which backward follows
        self._fwd_order: list[_Unit] = list(dict.fromkeys(self.units.values()))
        self._bwd_order: list[_Unit] = []
        self._fwd_seq: list[_Unit] = []  # units in the order this forward uses them
        self._packed: list[_Unit] = []  # units whose weight autograd saved in this forward
        self._unpacked = 0  # weights backward has asked for so far
        self._live: dict[int, _Unit] = {}  # storage address of a gathered weight -> its unit
        self._saved: dict[nn.Module, dict[str, Any]] = {}  # a running module's own parameters, to put back
        self._bytes: Counter = Counter()
        self.comm_bytes: dict[str, int] = {}  # payload bytes per collective kind in the last step

    # ------------------------------------------------------------------ gathering
    def _start_gather(self, u: _Unit) -> None:
        """Launch the async all-gather of `u` (cast first: in bf16 it moves half the bytes)."""
        with phase(f"ddp.fsdp.all_gather.{u.name}"):
            u.src = u.shard.detach().to(self.dtype)
            u.buf = torch.empty(u.padded, dtype=self.dtype, device=u.shard.device)
            u.work = dist.all_gather_single(u.buf, u.src, group=self.process_group, async_op=True)
        self._live[u.buf.untyped_storage().data_ptr()] = u
        self._bytes["all_gather"] += u.buf.numel() * u.buf.element_size()

    def _prefetch(self, order: list[_Unit], i: int) -> None:
        """Start gathering `order[i]`, the unit expected next, unless there is none or it is gathered already."""
        if i < len(order) and order[i].buf is None:
            self._start_gather(order[i])

    def _wait_gather(self, u: _Unit) -> torch.Tensor:
        """The full weight of `u`: gathered now unless a prefetch already did, waited for."""
        if u.buf is None:
            self._start_gather(u)
        if u.work is not None:
            with phase(f"ddp.fsdp.wait_gather.{u.name}"):
                u.work.wait()
            u.work = u.src = None
        return u.full()

    def _free(self, u: _Unit) -> None:
        if u.buf is not None:
            if u.work is not None:  # a prefetch nobody used: let it land before dropping its buffer
                u.work.wait()
            del self._live[u.buf.untyped_storage().data_ptr()]
            u.buf = u.work = u.src = None

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self._saved[module] = dict(module._parameters)
        u = self.units.get(module)
        if self.cast:  # replicated parameters (norms, biases) join the compute dtype; grads flow to fp32 masters
            for name, p in module._parameters.items():
                if p is not None and p.is_floating_point() and not (u is not None and name == "weight"):
                    module._parameters[name] = p.to(self.dtype)
        if u is not None:
            self._fwd_seq.append(u)
            # a plain tensor in _parameters, put there directly: setattr would demand a Parameter
            module._parameters["weight"] = _GatherWeight.apply(u.shard, self, u)
            self._prefetch(self._fwd_order, len(self._fwd_seq))  # overlaps this layer's compute

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        module._parameters.update(self._saved.pop(module, {}))
        if module in self.units:
            self._free(self.units[module])

    def _pack(self, t: torch.Tensor) -> Any:
        """Autograd saves a tensor: for a gathered weight, keep a note of where it lives instead of the tensor."""
        u = self._live.get(t.untyped_storage().data_ptr()) if t.layout == torch.strided else None
        if u is None:
            return t
        self._packed.append(u)
        return u, t.shape, t.stride(), t.storage_offset()

    def _unpack(self, packed: Any) -> torch.Tensor:
        """Backward needs a saved tensor: a weight is gathered again (or was prefetched), the next one prefetched."""
        if isinstance(packed, torch.Tensor):
            return packed
        u, size, stride, offset = packed
        full = self._wait_gather(u)
        self._unpacked += 1
        self._prefetch(self._bwd_order, self._unpacked)
        return full.as_strided(size, stride, offset)

    def _reduce_scatter(self, u: _Unit, grad: torch.Tensor) -> None:
        """Launch the async reduce-scatter of a full weight gradient into this rank's shard; free the weight."""
        with phase(f"ddp.fsdp.reduce_scatter.{u.name}"):
            # summed in fp32: a bf16 sum over ranks would round every partial sum (costs 2x the bf16 bytes)
            flat = grad.new_zeros(u.padded, dtype=torch.float32)
            flat[:u.numel] = grad.reshape(-1)
            out = torch.empty(u.shard.numel(), dtype=torch.float32, device=u.shard.device)
            work = dist.reduce_scatter_single(out, flat, group=self.process_group, async_op=True)
        u.grads.append((work, out, flat))
        self._bytes["reduce_scatter"] += flat.numel() * flat.element_size()
        self._free(u)

    # ------------------------------------------------------------------ the contract
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module with per-layer gathers; floating-point inputs are cast to `compute_dtype`."""
        if self.cast:
            cast = lambda a: a.to(self.dtype) if torch.is_tensor(a) and a.is_floating_point() else a  # noqa: E731
            args, kwargs = tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}
        self._fwd_seq, self._packed = [], []
        try:
            with phase("ddp.fsdp.forward"), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        finally:
            for u in self.units.values():
                self._free(u)  # prefetched for a layer that did not run
            # orders every rank saw alike: prefetching issues the same collectives on every rank
            self._fwd_order, self._bwd_order, self._unpacked = self._fwd_seq, self._packed[::-1], 0

    def finish_gradient_synchronization(self) -> None:
        """Wait for the reduce-scatters and all-reduce the replicated grads: every grad is the rank average."""
        with phase("ddp.fsdp.finish"):
            for p in self.replicated:
                if p.grad is None:  # unused in this step on this rank: contribute zeros, never hang
                    p.grad = torch.zeros_like(p)
            pending = []
            for same in group_by_kind([p.grad for p in self.replicated]):
                flat = _flatten_dense_tensors(same)
                pending.append((dist.all_reduce(flat, group=self.process_group, async_op=True), flat, same))
                self._bytes["all_reduce"] += flat.numel() * flat.element_size()
            for u in dict.fromkeys(self.units.values()):
                if not u.shard.requires_grad:
                    continue
                g = torch.zeros_like(u.shard)  # a layer unused in this step gets a zero gradient
                for work, out, _ in u.grads:  # several when a weight is used twice or backward ran twice
                    work.wait()
                    g += out
                u.grads = []
                g /= self.world_size
                u.shard.grad = g if u.shard.grad is None else u.shard.grad.add_(g)
            for work, flat, same in pending:
                work.wait()
                flat /= self.world_size
                for t, new in zip(same, _unflatten_dense_tensors(flat, same)):
                    t.copy_(new)
            for u in self.units.values():
                self._free(u)  # gathered for a backward that did not reduce it (a frozen weight)
        self.comm_bytes, self._bytes = dict(self._bytes), Counter()

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full fp32 tensor} for every parameter, named as in the wrapped module (a collective)."""
        units = {u.shard: u for u in self.units.values()}
        full = {}
        for name, p in self.module.named_parameters():
            u = units.get(p)
            if u is None:
                full[name] = p.detach().clone()
                continue
            flat = torch.empty(u.padded, dtype=torch.float32, device=p.device)
            dist.all_gather_single(flat, p.detach(), group=self.process_group)
            full[name] = flat[:u.numel].view(u.shape)
        return full
