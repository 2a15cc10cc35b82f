"""Rank-side code of the everyday-habit tests: re-wrapping, a forgotten finish, buffers, unused params, mixed dtypes."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib.comm import spy_on
from ddp_lib.kit.data import shard_batch
from ddp_lib.ddp import ENGINES
from ddp_lib.kit.models import MixedDtypeModel, ToyModel

from ddp_cases import make_batch, make_model, unused_reference, wrap


def rewrap_details(engine: str) -> dict:
    """Wrap one module twice: hooks of the first wrapper are gone, it is freed when dropped, it refuses use."""
    torch.manual_seed(0)
    model = ToyModel()
    first = wrap(engine, model, 25.0 if engine == "bucketed" else None)
    second = wrap(engine, model, 25.0 if engine == "bucketed" else None)
    hooks = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    try:
        first(torch.randn(4, 32))
        old_forward = "no error"
    except RuntimeError as e:
        old_forward = str(e)
    gone = weakref.ref(first)
    del first
    freed_without_gc = gone() is None
    # dropping the live wrapper: no parameter -> hook -> wrapper cycle keeps it (or its hooks) alive
    live = weakref.ref(second)
    gc.disable()
    try:
        del second
        live_freed_without_gc = live() is None
    finally:
        gc.enable()
    gc.collect()
    hooks_after_drop = [len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()]
    return {"hooks": hooks, "old_forward": old_forward, "freed": freed_without_gc,
            "live_freed": live_freed_without_gc, "hooks_after_drop": hooks_after_drop}


def big_model(seed: int = 0) -> nn.Module:
    """~8 MB of gradients: a gloo all-reduce of it takes longer than a small forward/backward."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 2048), nn.Tanh(), nn.Linear(2048, 1024), nn.Tanh(), nn.Linear(1024, 4))


def forgotten_finish_batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 64, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]


def forgotten_finish(engine: str) -> dict:
    """Synchronizing step without finish, then a no_sync step, then a synchronizing step with finish."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = big_model()
    ddp = wrap(engine, model, 25.0 if engine == "bucketed" else None)
    (xa, ya), (xb, yb), (xc, yc) = [(shard_batch(x, rank, ws), shard_batch(y, rank, ws))
                                    for x, y in forgotten_finish_batches()]
    F.cross_entropy(ddp(xa), ya).backward()  # no finish_gradient_synchronization() here: forgotten
    with ddp.no_sync():
        F.cross_entropy(ddp(xb), yb).backward()
    ddp.finish_gradient_synchronization()  # a no-op: the last forward was inside no_sync()
    after_no_sync = [p.grad.clone() for p in model.parameters()]
    try:
        F.cross_entropy(ddp(xc), yc).backward()
        ddp.finish_gradient_synchronization()
    except RuntimeError as e:  # reported after the no_sync step's gradients, which are checked first
        return {"after_no_sync": after_no_sync, "final": str(e)}
    return {"after_no_sync": after_no_sync, "final": [p.grad.clone() for p in model.parameters()]}


def forgotten_finish_reference(ws: int = 2) -> dict:
    """Gradients of the full batches A+B+C, and per rank: full A (averaged) + that rank's shard of B."""
    (xa, ya), (xb, yb), (xc, yc) = forgotten_finish_batches()

    def grads(*batches):
        model = big_model()
        for x, y in batches:
            F.cross_entropy(model(x), y).backward()
        return [p.grad for p in model.parameters()]

    mid = [grads((xa, ya), (shard_batch(xb, r, ws), shard_batch(yb, r, ws))) for r in range(ws)]
    return {"final": grads((xa, ya), (xb, yb), (xc, yc)), "after_no_sync": mid}


def bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 4))


def bn_batch(step: int, rank: int) -> torch.Tensor:
    """Rank-specific data (a different mean per rank), so unsynchronized running stats would differ."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 16, generator=g) + 3.0 * rank


def buffers(engine: str, broadcast_buffers: bool, steps: int = 3) -> torch.Tensor:
    """Train a BatchNorm model on rank-specific data; return this rank's running_mean."""
    rank = dist.get_rank()
    model = bn_model(seed=rank)
    kw = {"bucket_size_mb": 25.0} if engine == "bucketed" else {}
    ddp = ENGINES[engine](model, broadcast_buffers=broadcast_buffers, **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        ddp(bn_batch(step, rank)).pow(2).mean().backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    return model[0].running_mean.clone()


def unused_adamw(engine: str, steps: int = 3) -> dict:
    """AdamW with weight decay; `unused` takes part on no rank, `sometimes` only on rank 1."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = make_model("unused", seed=0)
    w0 = model.unused.weight.detach().clone()
    ddp = wrap(engine, model, 1e-4 if engine == "bucketed" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(steps):
        x, y = make_batch("unused", step)
        opt.zero_grad()
        F.cross_entropy(ddp(shard_batch(x, rank, ws), use_sometimes=rank == 1), shard_batch(y, rank, ws)).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    return {"w0": w0, "unused_grad": model.unused.weight.grad.clone(),
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def unused_adamw_reference(steps: int = 3, ws: int = 2) -> dict:
    make_opt = lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)  # noqa: E731
    return unused_reference(steps, ws, make_opt)["state"]


def mixed_bf16(engine: str) -> dict:
    """bf16 and fp32 parameters interleaved: collectives issued, and the grads next to each rank's local ones."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MixedDtypeModel()  # 8 parameters, bf16 and fp32 alternating
    local = MixedDtypeModel()
    local.load_state_dict(model.state_dict())
    ddp = wrap(engine, model, 25.0 if engine == "bucketed" else None)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    ddp(x).pow(2).mean().backward()
    ddp.finish_gradient_synchronization()
    local(x).pow(2).mean().backward()
    return {"calls": ddp.comm_calls, "grads": [p.grad.float() for p in model.parameters()],
            "local": [p.grad.float() for p in local.parameters()], "ws": ws}


def reentrant_middle(engine: str) -> dict:
    """A reentrant checkpoint around the middle layer (its backward is a nested backward): same grads as without."""
    from torch.utils.checkpoint import checkpoint

    class M(nn.Module):
        def __init__(self, use_checkpoint: bool):
            super().__init__()
            self.first, self.mid, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
            self.use_checkpoint = use_checkpoint

        def forward(self, x):
            h = torch.tanh(self.first(x))
            h = checkpoint(self.mid, h, use_reentrant=True) if self.use_checkpoint else self.mid(h)
            return self.head(torch.tanh(h))

    grads = {}
    for use in (True, False):
        torch.manual_seed(0)
        model = M(use)
        ddp = wrap(engine, model, 1e-4 if engine == "bucketed" else None)  # several buckets
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()), requires_grad=True)
        ddp(x).pow(2).mean().backward()
        ddp.finish_gradient_synchronization()
        grads[use] = [p.grad.clone() for p in model.parameters()]
    return grads


def freeze_after_wrapping(engine: str) -> dict:
    """AdamW step, freeze the first layer's weight, step, wrap again, step: a weight frozen after wrapping must not move."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    kw = 25.0 if engine == "bucketed" else None
    ddp = wrap(engine, model, kw)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
    x, y = shard_batch(x, rank, ws), shard_batch(y, rank, ws)

    def step() -> str | None:
        opt.zero_grad()
        try:
            F.cross_entropy(ddp(x), y).backward()
            ddp.finish_gradient_synchronization()
        except RuntimeError as e:
            return str(e)
        opt.step()
        return None

    assert step() is None
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    error = step()
    moved = not torch.equal(frozen, model[0].weight)
    ddp = wrap(engine, model, kw)  # the remedy the error names: wrap again
    error_after_rewrap = step()
    return {"error": error, "moved": moved, "error_after_rewrap": error_after_rewrap,
            "moved_after_rewrap": not torch.equal(frozen, model[0].weight),
            "grad_after_rewrap": model[0].weight.grad}


class TransposedParam(nn.Module):
    """A parameter made from a transposed view: its gradient has the same, non-contiguous, strides."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4).t())  # shape (4, 8), strides (1, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(x @ self.w.t()))


def noncontiguous_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)) for _ in range(2)]


def noncontiguous_grads(engine: str) -> dict:
    """Two synchronized SGD steps on TransposedParam: this rank's state, and the layout of every all-reduced tensor.

    gloo copies a non-contiguous tensor itself, NCCL raises "Tensors must be contiguous": so on gloo the
    layout of what enters dist.all_reduce is recorded (the engines call it through the module attribute).
    """
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TransposedParam()
    ddp = wrap(engine, model, 1e-4 if engine == "bucketed" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    layouts = []
    with spy_on("all_reduce", lambda tensor, *a, **k: layouts.append(tensor.is_contiguous())):
        for x, y in noncontiguous_batches():
            opt.zero_grad()
            F.mse_loss(ddp(shard_batch(x, rank, ws)), shard_batch(y, rank, ws)).backward()
            ddp.finish_gradient_synchronization()
            opt.step()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "contiguous": layouts}


def noncontiguous_reference() -> dict:
    """Single process, full batches; also says whether autograd really made w's gradient non-contiguous."""
    torch.manual_seed(0)
    model = TransposedParam()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    layouts = []
    for x, y in noncontiguous_batches():
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        layouts.append(model.w.grad.is_contiguous())
        opt.step()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "contiguous": layouts}


class _Recording:
    """Autograd's engine, recording every end-of-backward callback queued through it (and keeping it)."""

    def __init__(self, real) -> None:
        self.real, self.held = real, []

    def queue_callback(self, callback) -> None:
        self.held.append(callback)
        self.real.queue_callback(callback)

    def __getattr__(self, name):
        return getattr(self.real, name)


def callback_keeps_no_model(engine: str) -> dict:
    """A dropped wrapper's model is freed while the end-of-backward callbacks it queued are still held (autograd
    may hold one after backward returned): the callback holds the wrapper weakly."""
    torch.manual_seed(0)
    model = ToyModel()
    ddp = wrap(engine, model, 25.0 if engine == "bucketed" else None)
    recording = _Recording(torch.autograd.Variable._execution_engine)
    torch.autograd.Variable._execution_engine = recording
    try:
        for _ in range(2):
            ddp(torch.randn(4, 32)).sum().backward()
            ddp.finish_gradient_synchronization()
    finally:
        torch.autograd.Variable._execution_engine = recording.real
    gone = weakref.ref(model)
    del ddp, model
    gc.collect()
    return {"queued": len(recording.held), "model_freed": gone() is None}


CASE_FUNCTIONS = {"rewrap": rewrap_details, "callback": callback_keeps_no_model, "forgotten": forgotten_finish,
                  "buffers": buffers, "unused": unused_adamw, "bf16": mixed_bf16, "reentrant": reentrant_middle,
                  "freeze": freeze_after_wrapping, "noncontig": noncontiguous_grads}


def run_cases(cases: list[tuple]) -> dict:
    """Run every (name, *args) case on this rank, one process start for all; a failure is returned, not raised."""
    import traceback

    out = {}
    for case in cases:
        try:
            out[case] = CASE_FUNCTIONS[case[0]](*case[1:])
        except Exception:  # noqa: BLE001 - raised alike on every rank: the others cases still run
            out[case] = RuntimeError(traceback.format_exc())
    return out
