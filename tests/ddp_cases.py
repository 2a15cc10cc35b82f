"""The DDP property cases of the test suite: rank-side training, the single-process references, the engines'
habits; the models, batches and learning rate are the checkers' own (`ddp_lib.check.engine`), one copy."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.check.engine import GLOBAL_BATCH, LR, make_batch, make_model, state  # noqa: F401
from ddp_lib.contract import DataParallelWrapper
from ddp_lib.ddp import ENGINES
from ddp_lib.kit.data import shard_batch

STEPS = 5


def wrap(engine, model, bucket_mb: float | None = None, **kwargs):
    """Wrap `model` in `engine` (a name in ENGINES, or a class: the learner's), passing bucket_size_mb if given."""
    cls = ENGINES[engine] if isinstance(engine, str) else engine
    return cls(model, bucket_size_mb=bucket_mb, **kwargs) if bucket_mb is not None else cls(model, **kwargs)


def train_reference(model_name: str, steps: int = STEPS) -> tuple[dict, list[float]]:
    """Single process, full batch: the result every engine must reproduce (with or without accumulation)."""
    model = make_model(model_name, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = make_batch(model_name, step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return state(model), losses


def train_on_rank(engine, model_name: str, bucket_mb: float | None = None, accumulate: int = 1,
                  rewrap: bool = False, same_seed: bool | None = None, steps: int = STEPS, **kwargs):
    """Seeds differ per rank (wrapping must fix that), each rank trains on its shard of the global batch.

    `rewrap`: wrap the model twice, as a re-run notebook cell does, and train with the second wrapper.
    """
    rank, ws = dist.get_rank(), dist.get_world_size()
    # rank 0 uses the reference's seed; a wrapper of the shared contract broadcasts rank 0's state, lesson 02's class
    # verifies that the replicas already agree instead
    cls = ENGINES[engine] if isinstance(engine, str) else engine
    same_seed = not issubclass(cls, DataParallelWrapper) if same_seed is None else same_seed
    model = make_model(model_name, seed=0 if same_seed else rank * 17)
    ddp = wrap(engine, model, bucket_mb, **kwargs)
    if rewrap:
        ddp = wrap(engine, model, bucket_mb, **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses, calls = [], []
    for step in range(steps):
        x, y = make_batch(model_name, step)
        x, y = shard_batch(x, rank, ws), shard_batch(y, rank, ws)
        opt.zero_grad(set_to_none=step % 2 == 0)  # both zero_grad flavours
        micro = x.shape[0] // accumulate
        total = 0.0
        for m in range(accumulate):
            xs, ys = x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]
            last = m == accumulate - 1
            ctx = ddp.no_sync() if not last else nullcontext()
            with ctx:
                loss = F.cross_entropy(ddp(xs), ys) / accumulate
                loss.backward()
            total += loss.item()
        ddp.finish_gradient_synchronization()
        opt.step()
        t = torch.tensor([total])
        dist.all_reduce(t)
        losses.append(t.item() / ws)
        calls.append(getattr(ddp, "comm_calls", None))
    return {"state": state(model), "losses": losses, "calls": calls}


def run_matrix(cases: list[tuple]) -> dict:
    """Run every (engine, model, bucket_mb, accumulate, rewrap) case on this rank; a failure is returned, not raised."""
    import traceback

    out = {}
    for case in cases:
        try:
            out[case] = train_on_rank(*case)
        except Exception:  # noqa: BLE001 - raised alike on every rank: the other cases still run
            out[case] = RuntimeError(traceback.format_exc())
    return out


def wrap_state(engine: str) -> dict:
    """Each rank's state before and after wrapping a model built from a rank-specific seed."""
    rank = dist.get_rank()
    model = make_model("frozen", seed=rank * 17)
    before = state(model)
    ddp = wrap(engine, model, 25.0 if engine == "bucketed" else None)
    names = [n for n, _ in ddp.named_parameters()]
    same_objects = all(a is b for a, b in zip(ddp.parameters(), model.parameters()))
    return {"before": before, "after": state(model), "names": names,
            "module_names": [n for n, _ in model.named_parameters()], "same_objects": same_objects}


def unused_branch(engine: str, steps: int = 3) -> dict:
    """`unused` takes part nowhere, `sometimes` only on rank 1; compare to the full-batch reference."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = make_model("unused", seed=0)
    ddp = wrap(engine, model, 1e-4 if engine == "bucketed" else None)  # small buckets: several of them
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    grads = []
    for step in range(steps):
        x, y = make_batch("unused", step)
        x, y = shard_batch(x, rank, ws), shard_batch(y, rank, ws)
        opt.zero_grad()
        F.cross_entropy(ddp(x, use_sometimes=rank == 1), y).backward()
        ddp.finish_gradient_synchronization()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return {"state": state(model), "grads": grads}


def unused_reference(steps: int = 3, ws: int = 2, make_opt=None) -> dict:
    """One process, the full batch: each half as the rank that owns it runs it (SGD unless `make_opt(params)`)."""
    model = make_model("unused", seed=0)
    opt = make_opt(model.parameters()) if make_opt else torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step in range(steps):
        x, y = make_batch("unused", step)
        half = x.shape[0] // ws
        out = torch.cat([model(x[:half], use_sometimes=False), model(x[half:], use_sometimes=True)])
        opt.zero_grad()
        F.cross_entropy(out, y).backward()
        grads.append({n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()})
        opt.step()
    return {"state": state(model), "grads": grads}


def bucket_layout() -> dict:
    """Bucket order, and whether grads stay views of the same buffers across steps and zero_grad flavours."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    from ddp_lib.ddp import BucketedDDP
    from ddp_lib.kit.models import ToyModel

    torch.manual_seed(0)
    model = ToyModel(depth=3)
    ddp = BucketedDDP(model, bucket_size_mb=20_000 / 2**20)  # ~20 kB: several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    order_ok = [p for b in ddp.buckets for p in b.params] == list(reversed(list(model.parameters())))
    ptrs, views = [], []
    for step in range(4):
        x = torch.randn(8, 32)
        opt.zero_grad(set_to_none=step < 2)
        ddp(shard_batch(x, rank, ws)).pow(2).mean().backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        ptrs.append([b.buffer.data_ptr() for b in ddp.buckets])
        views.append(all(p.grad.data_ptr() == v.data_ptr() for b in ddp.buckets for p, v in zip(b.params, b.views)))
    return {"order_ok": order_ok, "n_buckets": len(ddp.buckets), "ptrs": ptrs, "views": views,
            # torch's rule: a bucket closes once it reaches the cap, so only its last parameter may overshoot it
            "closes_at_cap": all(sum(p.numel() * 4 for p in b.params[:-1]) < 20_000 for b in ddp.buckets)
            and all(b.buffer.numel() * 4 >= 20_000 for b in ddp.buckets[:-1])}


def reentrant_twice(engine: str) -> str:
    """A parameter used inside and outside a reentrant checkpoint gets two gradient arrivals."""
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(checkpoint(self.lin, x, use_reentrant=True))

    ddp = wrap(engine, M(), 25.0 if engine == "bucketed" else None)
    x = torch.randn(4, 8, requires_grad=True)
    try:
        ddp(x).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def bypass_wrapper(engine: str) -> list[str]:
    """Forward through ddp.module (not ddp) after one proper step; and finish twice."""
    from ddp_lib.kit.models import ToyModel

    ddp = wrap(engine, ToyModel(), 25.0 if engine == "bucketed" else None)
    x = torch.randn(4, 32)
    ddp(x).sum().backward()
    ddp.finish_gradient_synchronization()
    errors = []
    try:
        ddp.finish_gradient_synchronization()
    except RuntimeError as e:
        errors.append(str(e))
    try:
        ddp.module(x).sum().backward()
        ddp.finish_gradient_synchronization()
    except RuntimeError as e:
        errors.append(str(e))
    return errors
