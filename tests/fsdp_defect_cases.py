"""Rank-side code of the FSDP defect tests: each returns plain values the parent asserts on."""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib import comm
from ddp_lib.kit.data import shard_batch
from ddp_lib.fsdp import FSDP
from ddp_lib.fsdp.unit_group import UnitGroup
from ddp_lib.kit.models import Block, ToyModel, TransformerLM


def batch(step: int, ws: int, width: int = 32, classes: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (the same in every process)."""
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(2 * ws * 3, width, generator=g), torch.randint(0, classes, (2 * ws * 3,), generator=g)


def local(t: torch.Tensor) -> torch.Tensor:
    return shard_batch(t, dist.get_rank(), dist.get_world_size())


LIVE_BOUND = (2, 1)  # what tests/test_fsdp_defects.py allows alive at a collective: 2 gathered units, 1 reduce-scatter


class Watch:
    """Weak references to every all-gather output and reduce-scatter input; how many were alive at each call.

    It observes the package's collective layer (`ddp_lib.comm.observe`): every FSDP collective passes there."""

    compares_every_call = False

    def __init__(self):
        self.gathered: list[weakref.ref] = []
        self.rs_inputs: list[weakref.ref] = []
        self.log: list[tuple[str, int, int]] = []  # (kind, gathered alive, reduce-scatter inputs alive) before it
        self._observing = comm.observe(self)
        self._observing.__enter__()

    def alive(self, bound: tuple[int, int] = (0, 0)) -> tuple[int, int]:
        """(all-gather outputs, reduce-scatter inputs) alive, once at most `bound` are or after a second.

        The wait is for gloo: `Work.wait()` returns when its worker thread marks the work completed, and that
        thread drops its own reference to the work, and so to its tensors, only after (ProcessGroupGloo's
        `runLoop` resets `workInProgress_` once `execute` returns). On a loaded machine that can come later than
        this count; a tensor that FSDP itself keeps is still alive after the second, and fails the bound.
        """
        deadline = time.monotonic() + 1.0
        while True:
            counts = (sum(r() is not None for r in self.gathered), sum(r() is not None for r in self.rs_inputs))
            if (counts[0] <= bound[0] and counts[1] <= bound[1]) or time.monotonic() > deadline:
                return counts
            time.sleep(0.002)

    def before_collective(self, kind, payload, group, label) -> None:
        if kind in ("all_gather", "reduce_scatter"):  # payloads: the gather's output, the reduce-scatter's input
            self.log.append((kind, *self.alive(bound=LIVE_BOUND)))
            (self.gathered if kind == "all_gather" else self.rs_inputs).append(weakref.ref(payload))

    def close(self) -> None:
        self._observing.__exit__(None, None, None)


def frozen_middle(width: int = 32, depth: int = 6) -> nn.Sequential:
    """An MLP whose 4 middle layers are frozen (a frozen backbone between trainable ends)."""
    torch.manual_seed(0)
    layers = []
    for i in range(depth):
        lin = nn.Linear(width, width)
        lin.requires_grad_(i in (0, depth - 1))
        layers += [lin, nn.Tanh()]
    return nn.Sequential(*layers)


def memory() -> dict:
    """Defects 1 and 2: full-size tensors alive at the end of backward and at each collective during it."""
    out = {}
    for name, make in (("mlp", lambda: ToyModel(32, 32, 8, depth=6)), ("frozen", frozen_middle)):
        torch.manual_seed(0)
        fsdp = FSDP(make())
        x, y = batch(0, dist.get_world_size())
        watch = Watch()
        try:
            loss = F.cross_entropy(fsdp(local(x))[:, :8], local(y))
            forward_calls = len(watch.log)
            loss.backward()  # no finish: what backward alone leaves behind
            live = {u for u, _ in fsdp._comm.live.values()}  # storage -> (unit, index)
            out[name] = {"after_backward": watch.alive(), "forward": watch.log[:forward_calls],
                         "backward": watch.log[forward_calls:], "live_units": len(live)}
        finally:
            watch.close()
    return out


def reference_mlp(steps: int, ws: int, clip: float | None = None) -> tuple[nn.Module, list]:
    """One process, full batch: ToyModel after `steps` SGD steps (optionally clipped); norms before clipping."""
    torch.manual_seed(0)
    model = ToyModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(steps):
        x, y = batch(step, ws)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return model, norms


def max_diff(full: dict, model: nn.Module) -> float:
    return max((full[n].float() - p.detach().float()).abs().max().item() for n, p in model.named_parameters())


def train(fsdp: FSDP, steps: int, finish: bool = True, clip: float | None = None, lr: float = 0.1) -> list:
    opt = torch.optim.SGD(fsdp.parameters(), lr=lr)
    norms = []
    for step in range(steps):
        x, y = batch(step, dist.get_world_size())
        opt.zero_grad()
        F.cross_entropy(fsdp(local(x)).float(), local(y)).backward()
        if finish:
            fsdp.finish_gradient_synchronization()
        if clip is not None:
            norms.append(fsdp.clip_grad_norm_(clip).item())
        opt.step()
    return norms


def sections(*fns) -> dict:
    """Run each section on this rank; one that raises records its error and the next still runs (old code fails
    each test on its own assertion, not all of them on the first missing method)."""
    out: dict = {}
    for fn in fns:
        try:
            fn(out)
        except Exception as err:  # noqa: BLE001 - reported to the parent as this section's result
            out.setdefault("errors", {})[fn.__name__] = f"{type(err).__name__}: {err}"
        dist.barrier()
    return out


def contract() -> dict:
    """Defects 3-7: forgotten finish, checkpoints, clipping, re-wrap; no_sync accumulation."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    ref, _ = reference_mlp(3, ws)
    directory = Path(tempfile.gettempdir()) / f"fsdp-test-{ws}-{_shared_token()}"
    state: dict = {}

    def no_finish(out):
        torch.manual_seed(rank * 10)  # rank 0: seed 0; construction broadcasts its weights
        state["fsdp"] = fsdp = FSDP(ToyModel())
        train(fsdp, 3, finish=False)
        out["no_finish_diff"] = max_diff(fsdp.gather_full_params(), ref)

    def full_state_dict(out):  # the plain model's names and shapes; rank 0's file loads on every rank
        torch.manual_seed(0)
        fsdp = FSDP(ToyModel())
        train(fsdp, 3)
        sd = fsdp.state_dict()
        plain = ToyModel()
        plain.load_state_dict(sd, strict=True)
        out["plain_from_state_dict"] = max_diff(dict(plain.named_parameters()), ref)
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(sd, directory / "full.pt")
        dist.barrier()
        torch.manual_seed(rank * 99)
        other = FSDP(ToyModel())
        other.load_state_dict(torch.load(directory / "full.pt", weights_only=True))
        out["loaded_full_diff"] = max_diff(other.gather_full_params(), ref)

    def sharded(out):  # a file per rank; loading it with another world size is a clear error
        torch.manual_seed(0)
        fsdp = FSDP(ToyModel())
        train(fsdp, 3)
        fsdp.save_sharded(directory / "sharded")
        dist.barrier()
        torch.manual_seed(rank * 7)
        again = FSDP(ToyModel())
        again.load_sharded(directory / "sharded")
        mine, loaded = fsdp.gather_full_params(), again.gather_full_params()
        out["loaded_sharded_diff"] = max((mine[n] - loaded[n]).abs().max().item() for n in mine)  # bit for bit
        out["files"] = sorted(p.name for p in (directory / "sharded").iterdir())
        group = dist.new_group(list(range(ws - 1)))  # every rank takes part in creating it
        if rank < ws - 1:
            FSDP(ToyModel(), process_group=group).save_sharded(directory / "smaller")
        dist.barrier()
        try:
            FSDP(ToyModel()).load_sharded(directory / "smaller")
            out["mismatch"] = "no error"
        except (FileNotFoundError, ValueError) as err:
            out["mismatch"] = str(err)

    def clipping(out):  # the full gradient's norm, as one process clips it
        ref_clip, ref_norms = reference_mlp(2, ws, clip=0.05)
        torch.manual_seed(0)
        clipped = FSDP(ToyModel())
        out["clip_norms"] = (train(clipped, 2, clip=0.05), ref_norms)
        out["clip_diff"] = max_diff(clipped.gather_full_params(), ref_clip)

    def rewrap(out):  # the old wrapper detaches and hands back full weights; the new one trains right
        torch.manual_seed(0)
        model = ToyModel()
        first = FSDP(model)
        second = FSDP(model)
        train(second, 3)
        out["rewrap_diff"] = max_diff(second.gather_full_params(), ref)
        try:
            first(torch.randn(2, 32))
            out["old_wrapper"] = "no error"
        except RuntimeError as err:
            out["old_wrapper"] = str(err)

    def no_sync(out):  # two micro-batches: one accumulated locally (no reduce-scatter, no all-reduce), one synced
        torch.manual_seed(0)
        acc = FSDP(ToyModel())
        opt = torch.optim.SGD(acc.parameters(), lr=0.1)
        watch, calls, orig_all_reduce = Watch(), [], dist.all_reduce
        dist.all_reduce = lambda *a, **k: (calls.append("all_reduce"), orig_all_reduce(*a, **k))[1]
        try:
            for step in range(3):
                x, y = batch(step, ws)
                x, y = local(x), local(y)
                opt.zero_grad()
                half = len(x) // 2
                watch.log.clear()
                calls.clear()
                with acc.no_sync():
                    (F.cross_entropy(acc(x[:half]), y[:half]) / 2).backward()
                out.setdefault("no_sync_calls", []).append(
                    ([k for k, *_ in watch.log].count("reduce_scatter"), len(calls)))
                (F.cross_entropy(acc(x[half:]), y[half:]) / 2).backward()
                acc.finish_gradient_synchronization()
                opt.step()
        finally:
            watch.close()
            dist.all_reduce = orig_all_reduce
        out["no_sync_diff"] = max_diff(acc.gather_full_params(), ref)

    out = sections(no_finish, full_state_dict, sharded, clipping, rewrap, no_sync)
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    return out


def _shared_token() -> int:
    """A number every rank agrees on (rank 0's), so that all ranks use one temporary directory."""
    t = torch.randint(0, 10**9, (1,), device="cpu") if dist.get_rank() == 0 else torch.zeros(1, dtype=torch.int64)
    dist.broadcast(t, 0)
    return int(t.item())


def guards() -> dict:
    """Defects 8-11: autocast, a module reading a child's weight, a bf16 model, rank-dependent order, buffers."""
    rank, ws = dist.get_rank(), dist.get_world_size()

    def autocast(out):
        torch.manual_seed(0)
        fsdp = FSDP(ToyModel())
        out["full_shapes"] = [tuple(getattr(p, "full_shape", p.shape)) for p in fsdp.parameters()]
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                fsdp(torch.randn(2, 32))
            out["autocast"] = "no error"
        except RuntimeError as err:
            out["autocast"] = str(err)

    def layer() -> nn.Module:
        torch.manual_seed(3)
        return nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)

    def mha(out):  # nn.TransformerEncoderLayer: MultiheadAttention reads out_proj.weight itself
        xs = torch.randn(2 * ws, 5, 16, generator=torch.Generator().manual_seed(4))
        plain, wrapped = layer(), FSDP(layer())
        for model in (plain, wrapped):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(2):
                opt.zero_grad()
                model(xs if model is plain else local(xs)).pow(2).mean().backward()
                if model is wrapped:
                    model.finish_gradient_synchronization()
                opt.step()
        out["mha_diff"] = max_diff(wrapped.gather_full_params(), plain)

    def bf16(out):  # a model already in bf16, no compute_dtype: computes and keeps its weights in bf16
        torch.manual_seed(0)
        bf = FSDP(ToyModel().bfloat16())
        x, y = batch(0, ws)
        logits = bf(local(x).bfloat16())
        F.cross_entropy(logits.float(), local(y)).backward()
        bf.finish_gradient_synchronization()
        out["bf16"] = (logits.dtype, {p.dtype for p in bf.parameters()}, {p.grad.dtype for p in bf.parameters()})

    def debug(out):  # rank-dependent order of two same-sized layers: debug=True notices once per step, everywhere
        torch.manual_seed(0)
        dbg = FSDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), debug=True)
        order = [dbg.module[0], dbg.module[1]][::(1 if rank == 0 else -1)]

        def swapped(x):
            for m in order:
                x = m(x)
            return x
        dbg.module.forward = swapped
        try:
            dbg(torch.randn(2, 8, requires_grad=True)).sum().backward()
            dbg.finish_gradient_synchronization()
            out["debug"] = "no error"
        except RuntimeError as err:
            out["debug"] = str(err)

    def buffers(out):  # rank 0's at every synchronizing forward (BatchNorm statistics stay equal)
        torch.manual_seed(0)
        bn = FSDP(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))
        seen = []  # BatchNorm's running mean as each forward reaches it (after FSDP's broadcast, before its update)
        bn.module[1].register_forward_pre_hook(lambda m, a: seen.append(m.running_mean.clone()))
        for _ in range(2):
            bn(torch.randn(4, 8) * (rank + 1)).sum().backward()  # every rank updates the statistics its own way
            bn.finish_gradient_synchronization()
        everyone = [torch.empty_like(seen[-1]) for _ in range(ws)]
        dist.all_gather(everyone, seen[-1])
        out["buffers_equal_at_forward"] = all(torch.equal(everyone[0], m) for m in everyone)

    def reads_child(out):  # a parent reading a sharded child's weight directly: the error says what to do
        class Parent(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                return F.linear(x, self.lin.weight)  # never calls self.lin

        try:
            FSDP(Parent())(torch.randn(2, 4))
            out["reads_child"] = "no error"
        except RuntimeError as err:
            out["reads_child"] = " ".join([str(err), *getattr(err, "__notes__", [])])
        torch.manual_seed(0)
        fixed = FSDP(Parent(), units=(Parent,))  # the parent as one unit: its children's weights gathered first
        out["reads_child_as_unit"] = tuple(fixed(torch.randn(2, 4)).shape)

    return sections(autocast, mha, bf16, debug, buffers, reads_child)


def units() -> dict:
    """TransformerLM with units=(Block,): one all-gather per block per pass, one reduce-scatter per block."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 512, (2 * ws, 17), generator=g)
    torch.manual_seed(0)
    ref = TransformerLM("tiny")
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(ref(tokens).reshape(-1, 512), tokens.reshape(-1)).backward()
        opt.step()
    names: list[tuple[str, str]] = []

    class Launches(UnitGroup):  # each collective's unit, in the order it is launched
        def reduce_scatter(self, flat):
            names.append(("reduce_scatter", self.name))
            super().reduce_scatter(flat)

        def unshard(self):
            names.append(("all_gather", self.name))
            super().unshard()

    class Named(FSDP):
        UnitGroup = Launches

    for mode, kwargs in (("per-linear", {}), ("per-block", {"units": (Block,)})):
        torch.manual_seed(0)
        fsdp = Named(TransformerLM("tiny"), **kwargs)
        watch = Watch()
        opt = torch.optim.SGD(fsdp.parameters(), lr=0.05)
        try:
            for step in range(2):
                names.clear()
                watch.log.clear()
                opt.zero_grad()
                mine = local(tokens)
                F.cross_entropy(fsdp(mine).reshape(-1, 512), mine.reshape(-1)).backward()
                opt.step()
        finally:
            watch.close()
        out[mode] = {"names": list(names), "collectives": [k for k, *_ in watch.log], "bytes": dict(fsdp.comm_bytes),
                     "diff": max_diff(fsdp.gather_full_params(), ref),
                     "units": [u.name for u in dict.fromkeys(fsdp.units.values())]}
    return out


# ---------------------------------------------------------------- GPU (NCCL): run by tests/test_fsdp_gpu.py


def gpu_train(dtype: torch.dtype | None) -> dict:
    """FSDP on this rank's GPU against the same recipe in one process on it: max difference after 3 steps."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ws = dist.get_world_size()
    torch.manual_seed(dist.get_rank())
    fsdp = FSDP(ToyModel().to(dev), compute_dtype=dtype)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    torch.manual_seed(0)
    plain = ToyModel().to(dev)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step, ws)
        x, y = x.to(dev), y.to(dev)
        opt.zero_grad()
        F.cross_entropy(fsdp(local(x)).float(), local(y)).backward()
        opt.step()
        ref_opt.zero_grad()
        if dtype is None:
            out = plain(x)
        else:  # the recipe: weights cast to dtype for forward and backward, fp32 masters
            params = {n: p.to(dtype) for n, p in plain.named_parameters()}
            out = torch.func.functional_call(plain, params, (x.to(dtype),))
        F.cross_entropy(out.float(), y).backward()
        ref_opt.step()
    return {"diff": max_diff(fsdp.gather_full_params(), plain),
            "devices": sorted({str(p.device) for p in fsdp.parameters()})}


def gpu_peak_memory() -> dict:
    """Peak GPU memory (max_memory_allocated) from the start of a step to the end of its backward: DDP vs FSDP."""
    from ddp_lib.ddp import BucketedDDP

    dev = torch.device("cuda", torch.cuda.current_device())
    out = {}
    for scheme in ("DDP", "FSDP"):
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.manual_seed(0)
        model = ToyModel(1024, 4096, 1024, depth=6).to(dev)
        engine = FSDP(model, compute_dtype=torch.bfloat16) if scheme == "FSDP" else BucketedDDP(model)
        opt = torch.optim.AdamW(engine.parameters(), lr=1e-4)
        x = torch.randn(8, 1024, device=dev)
        for step in range(2):  # the second step: the optimizer state exists
            torch.cuda.reset_peak_memory_stats(dev)
            opt.zero_grad()
            engine(x).float().pow(2).mean().backward()
            torch.cuda.current_stream(dev).synchronize()
            peak = torch.cuda.max_memory_allocated(dev) - base
            engine.finish_gradient_synchronization()
            opt.step()
        out[scheme] = peak
        del engine, opt, model
    return out
