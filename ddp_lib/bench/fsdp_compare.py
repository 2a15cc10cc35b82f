"""Lesson 08's measurement harnesses: memory held at the end of backward per scheme, one FSDP step's timeline, and
the course's FSDP trained side by side with torch's `fully_shard` (FSDP2)."""
from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib import comm
from ddp_lib.kit.memory import reachable_tensors
from ddp_lib.kit.data import shard_batch
from ddp_lib.ddp import BucketedDDP
from ddp_lib.devices import comm_device
from ddp_lib.fsdp import FSDP
from ddp_lib.fsdp.unit_group import UnitGroup
from ddp_lib.torch_fsdp.dcp import gather_full
from ddp_lib.zero import ShardedOptimizer

MiB = 2**20
KINDS = ("params", "grads", "optim", "engine")


class ObservedGroup(UnitGroup):
    """A unit group that tells the FSDP that built it (`observer`) of its gathers, backward and reduce-scatter."""

    observer: "MeasuredFSDP"

    def unshard(self) -> None:
        super().unshard()
        self.observer.on_gather(self)

    def pre_backward(self) -> list[torch.Tensor]:
        fulls = super().pre_backward()
        self.observer.on_backward(self)  # backward reached the unit: its weight is here
        return fulls

    def post_backward(self, grads: tuple, sync: bool) -> None:
        self.observer.on_reduce(self)
        super().post_backward(grads, sync)


class MeasuredFSDP(FSDP):
    """FSDP that also records the largest number of bytes of full weights gathered at once."""

    UnitGroup = ObservedGroup
    peak_gathered = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for u in self._layout.unique:
            u.observer = self

    def on_gather(self, u: UnitGroup) -> None:
        """An all-gather was launched."""
        live = sum(v.flat.size * self.world_size * self.dtype.itemsize for v in self.units.values() if v.gathered)
        self.peak_gathered = max(self.peak_gathered, live)

    def on_backward(self, u: UnitGroup) -> None:
        """Backward reached unit `u` (gathered again)."""

    def on_reduce(self, u: UnitGroup) -> None:
        """Unit `u`'s gradients are complete."""


def held(engine: torch.nn.Module, opt: Any) -> dict[str, int]:
    """Bytes of the distinct storages reachable from engine, parameters, gradients and optimizer, by kind."""
    params = list(engine.parameters())
    kinds = {"params": params, "grads": [p.grad for p in params if p.grad is not None],
             "optim": reachable_tensors(vars(opt), set()), "engine": reachable_tensors(vars(engine), set())}
    seen, out = set(), {}
    for kind, tensors in kinds.items():  # a gradient that is a view of a bucket counts once, as a gradient
        out[kind] = 0
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen and t.numel() > 1:
                seen.add(key)
                out[kind] += t.untyped_storage().nbytes()
    return out


def memory_of(scheme: str, make_model: Callable[[], torch.nn.Module], batches: list, device: torch.device) -> dict:
    """Bytes held at the end of backward (and the peak gathered / CUDA peak) for "DDP", "ZeRO-1" or "FSDP"."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)  # what earlier cells still hold
    model = make_model()
    engine = MeasuredFSDP(model) if scheme == "FSDP" else BucketedDDP(model)
    params = list(engine.parameters())
    opt = (ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3) if scheme == "ZeRO-1"
           else torch.optim.AdamW(params, lr=1e-3))
    row: dict = {}
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(engine(shard_batch(x, rank, world)), shard_batch(y, rank, world)).backward()
        row = held(engine, opt)  # the end of backward: the engines synchronized when it ended
        engine.finish_gradient_synchronization()
        opt.step()
    row["gathered"] = getattr(engine, "peak_gathered", 0)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
        row["peak"] = torch.cuda.max_memory_allocated(device) - base
    del engine, opt, model, params  # free each scheme before measuring the next
    return row


def memory_table(mem: dict[str, dict]) -> str:
    """The per-scheme table of MiB held at the end of backward, with each total as a share of DDP's."""
    ddp_total = sum(mem["DDP"][k] for k in KINDS)
    lines = [f"rank {dist.get_rank()}, MiB at the end of backward  params   grads  optimizer  engine  total  (of DDP)"]
    for scheme, m in mem.items():
        total = sum(m[k] for k in KINDS)
        lines.append(f"{scheme:>34} {m['params'] / MiB:7.2f} {m['grads'] / MiB:7.2f} {m['optim'] / MiB:10.2f} "
                     f"{m['engine'] / MiB:7.2f} {total / MiB:6.2f}  ({100 * total / ddp_total:3.0f} %)")
    return "\n".join(lines)


def stamp(cuda: bool):
    """Now: a CUDA event on the current stream (GPU) or the host clock (CPU)."""
    if cuda:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()


class TimedFSDP(MeasuredFSDP):
    """FSDP that stamps its gathers, reduce-scatters, and each layer's forward and backward.

    A gather's end is stamped on the communication side, when its data is there, not when compute waits for it:
    a callback on the `Work`'s future. Under NCCL torch runs that callback with a stream that waits for the
    collective's kernels (`torch/futures/__init__.py`, `Future.then`), so the CUDA event recorded there marks the
    gather's end on the device; under gloo the callback runs on the host when the data has arrived, so the stamp
    is host time (`time.perf_counter`), the CPU being the device.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cuda = next(self.parameters()).device.type == "cuda"
        self.events, self._open = [], None
        for m, u in self.units.items():  # registered after FSDP's hooks: they time the compute only
            m.register_forward_pre_hook(lambda m, a, u=u: self._begin("forward", u))
            m.register_forward_hook(lambda m, a, out: self._end())

    def _begin(self, kind, u):
        self._end()
        self._open = [kind, u.name, stamp(self.cuda), None]
        self.events.append(self._open)

    def _end(self):
        if self._open is not None:
            self._open[3], self._open = stamp(self.cuda), None

    def on_gather(self, u):
        super().on_gather(u)
        rec = ["all-gather", u.name, stamp(self.cuda), None]
        self.events.append(rec)
        # the data is here: stamped by whoever completes the future (gloo's thread; NCCL's callback stream)
        u.all_gather_work().get_future().then(lambda fut: rec.__setitem__(3, stamp(self.cuda)))

    def on_backward(self, u):
        self._begin("backward", u)

    def on_reduce(self, u):
        self._end()
        t = stamp(self.cuda)
        self.events.append(["reduce-scatter", u.name, t, t])


def time_step(timed: TimedFSDP, x: torch.Tensor, y: torch.Tensor, steps: int = 3) -> dict:
    """Run `steps` steps (the last is kept) and return its events in ms, forward/step ends and gather overlap."""
    cuda = timed.cuda
    for _ in range(steps):  # the last step is drawn; the first ones warm up
        timed.events = []
        comm.barrier()
        if cuda:
            torch.cuda.current_stream().synchronize()
        t0 = stamp(cuda)
        loss = F.cross_entropy(timed(x), y)
        t_fwd = stamp(cuda)
        loss.backward()
        timed.finish_gradient_synchronization()
        t_end = stamp(cuda)
        if cuda:
            torch.cuda.synchronize()  # every stream: the gathers' end events are on the callback streams
    ms = (lambda t: t0.elapsed_time(t)) if cuda else (lambda t: 1e3 * (t - t0))  # noqa: E731
    events = [(kind, name, ms(a), ms(b if b is not None else t_end)) for kind, name, a, b in timed.events]
    gathers = [(a, b) for kind, _, a, b in events if kind == "all-gather"]
    computing = [(a, b) for kind, _, a, b in events if kind in ("forward", "backward")]
    beside = sum(max(0.0, min(b, d) - max(a, c)) for a, b in gathers for c, d in computing)
    return {"events": events, "forward_ms": ms(t_fwd), "step_ms": ms(t_end), "gathers": gathers,
            "gather_ms": sum(b - a for a, b in gathers), "beside_ms": beside}


def side_by_side(make_model: Callable[[], torch.nn.Module], batches: list, block_types: tuple[type, ...],
                 compute_dtype: torch.dtype | None = None, lr: float = 0.1, mesh=None) -> dict:
    """Train the same model with the course's `FSDP` and with torch's `fully_shard` (each `block_types` module,
    then the root; `MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)` when `compute_dtype`
    is set, as the course reduces in fp32), SGD on this rank's share of each global batch `(x, y)`.

    Returns each step's local losses for both, the largest difference of the full parameters at the end, and
    the type of `fully_shard`'s parameters (DTensor: each parameter sharded on dim 0, `Shard(0)`).
    `mesh`: a 2-D ("replicate", "shard") mesh gives both HSDP (`FSDP(mesh=mesh)`, `fully_shard(mesh=mesh)`).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from ddp_lib.compat import fsdp2
    fully_shard, MixedPrecisionPolicy = fsdp2()

    rank, ws = dist.get_rank(), dist.get_world_size()
    base = make_model()
    theirs = copy.deepcopy(base)
    ours = FSDP(base, compute_dtype=compute_dtype, units=block_types, mesh=mesh)
    dev = comm_device()
    for t in theirs.state_dict().values():  # rank 0's initialisation, as FSDP's construction broadcasts it
        buf = t.detach().to(dev)  # tensors on the communication device: NCCL refuses CPU tensors
        comm.broadcast(buf, 0)
        t.copy_(buf)
    mesh = init_device_mesh(dev.type, (ws,)) if mesh is None else mesh
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32 if compute_dtype else None)
    for m in [m for m in theirs.modules() if isinstance(m, block_types)] + [theirs]:
        fully_shard(m, mesh=mesh, mp_policy=mp)
    out: dict = {"ours": [], "fully_shard": []}
    for model, key in ((ours, "ours"), (theirs, "fully_shard")):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(shard_batch(x, rank, ws)).float(), shard_batch(y, rank, ws))
            loss.backward()
            opt.step()
            out[key].append(loss.item())
    full_ours = ours.gather_full_params()
    full_theirs = {n: gather_full(p) for n, p in theirs.named_parameters()}
    out["max_param_diff"] = max((full_ours[n] - full_theirs[n]).abs().max().item() for n in full_ours)
    out["param_type"] = type(next(theirs.parameters())).__name__
    out["placements"] = str(next(theirs.parameters()).placements)
    return out


def hsdp_side_by_side(make_model: Callable[[], torch.nn.Module], batches: list, block_types: tuple[type, ...],
                      replicas: int = 2) -> dict:
    """`side_by_side` on a (replicas, world / replicas) ("replicate", "shard") mesh: the course's `FSDP(mesh=...)`
    beside `fully_shard(mesh=...)`, HSDP both; also this rank's two groups (global ranks) and its comm calls."""
    from ddp_lib.fsdp.collectives import hsdp_groups, hsdp_mesh

    mesh = hsdp_mesh(replicas, dist.get_world_size() // replicas)
    out = side_by_side(make_model, batches, block_types, mesh=mesh)
    out["groups"] = {dim: dist.get_process_group_ranks(g) for dim, g in zip(("shard", "replicate"), hsdp_groups(mesh))}
    return out
