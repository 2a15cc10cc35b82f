"""check_accumulation: lesson 03's no_sync gradient accumulation against the big batch."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ddp_lib.check._runner import CheckResult, Mismatch, Property, collectives, learner_namespaces, max_diff, run_check
from ddp_lib.check.basics import LR, SHAPES, STEPS, _batch, _model, _params, _rank_ws
from ddp_lib.kit.data import shard_batch
from ddp_lib.kit.models import ToyModel
from ddp_lib.devices import needs_process_group


@needs_process_group
def check_accumulation(fn: Callable, engine: type | None = None, timeout_s: float | None = None) -> CheckResult:
    """`fn(ddp, micro_batches, loss_fn)` runs one optimizer step's forward/backward passes (lesson 03).

    `micro_batches` is this rank's list of `(x, y)`; `loss_fn(output, y)` the mean loss of one micro-batch.
    `fn` must run forward and backward of every micro-batch but the last inside `ddp.no_sync()`,
    scale each loss by 1/len(micro_batches), and leave every rank holding the gradient of the whole
    global batch, synchronised once (`ddp.sync_gradients()` for lesson 02's class, or
    `ddp.finish_gradient_synchronization()`). It must not step the optimizer nor zero the grads.
    `engine` (default `SimpleDistributedDataParallelism`) wraps the model; one property also runs `fn` with
    a hook-based engine (lesson 05's `OverlapDDP`, whose forward decides whether its backward reduces).
    """
    from ddp_lib.ddp import SimpleDistributedDataParallelism

    acc = _Accumulation(fn, engine or SimpleDistributedDataParallelism)
    big = ("equals the big batch",)
    return run_check("check_accumulation", [
        Property("equals the big batch", acc.big_batch,
                 "divide each micro-batch's loss by their number; sync after the last micro-batch, not the first"),
        Property("one sync per step (no_sync silent)", acc.one_sync,
                 "run forward and backward of every micro-batch but the last inside ddp.no_sync()", needs=big),
        Property("a hook engine agrees (forward inside no_sync)", acc.hook_engine,
                 "put each micro-batch's forward inside `with ddp.no_sync():` too, and run the last one outside it: "
                 "engines that reduce during backward (torch DDP, lesson 05) decide in the forward whether its "
                 "backward communicates", needs=big + ("one sync per step (no_sync silent)",)),
    ], timeout_s, learner_namespaces(fn))


class _Accumulation:
    """The setup (this rank, 4 micro-batches of 2 samples) and one method per property's evidence."""

    def __init__(self, fn: Callable, engine: type) -> None:
        self.fn, self.engine = fn, engine
        self.rank, self.ws = _rank_ws()
        self.accum = 4
        self.batch = self.ws * self.accum * 2  # 2 samples per micro-batch
        self.first_grads = None  # the gradients of the last run's first step, for a diagnosis

    def run(self, cfg: dict, ddp_fn: Callable | None, wrap: Callable | None = None) -> tuple[dict, list]:
        """STEPS optimizer steps: the big batch on one model (`ddp_fn` None), or `ddp_fn`'s micro-batches."""
        model = _model(lambda: ToyModel(**cfg))
        ddp = (wrap or self.engine)(model) if ddp_fn else None
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        counts = []
        self.first_grads = None
        for step in range(STEPS):
            x, y = _batch(step, self.batch, cfg["in_dim"], cfg["out_dim"])
            opt.zero_grad()
            if ddp_fn is None:
                F.cross_entropy(model(x), y).backward()
            else:
                xs = shard_batch(x, self.rank, self.ws).chunk(self.accum)
                ys = shard_batch(y, self.rank, self.ws).chunk(self.accum)
                n0 = len(collectives())
                ddp_fn(ddp, list(zip(xs, ys)), F.cross_entropy)
                counts.append(len(collectives()) - n0)
            if step == 0:
                self.first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                    if p.grad is not None}
            opt.step()
        return _params(model), counts

    def big_batch(self) -> float:
        worst = 0.0
        for name, cfg in SHAPES.items():
            want, _ = self.run(cfg, None)
            want_grads = self.first_grads
            got, _ = self.run(cfg, self.fn)
            try:
                worst = max(worst, max_diff(got, want, what=f"{name}, after {STEPS} steps: "))
            except Mismatch as e:
                _diagnose(self.first_grads, want_grads, self.accum, e)
                raise
        return worst

    def _one_sync_count(self, wrap: Callable, model, sync_backward: bool) -> int:
        """The collectives one synchronisation issues (`sync_backward`: counting the backward's too)."""
        ddp = wrap(model)
        x, y = _batch(0, self.batch // self.ws)
        if sync_backward:
            n0 = len(collectives())
        F.cross_entropy(ddp(x), y).backward()
        if not sync_backward:
            n0 = len(collectives())
        ddp.finish_gradient_synchronization()
        return len(collectives()) - n0

    def one_sync(self) -> None:
        cfg = SHAPES["mlp 16-32-4"]
        expected = self._one_sync_count(self.engine, _model(lambda: ToyModel(**cfg)), sync_backward=False)
        _, counts = self.run(cfg, self.fn)
        if any(c != expected for c in counts):
            raise Mismatch(f"{max(counts)} collectives per optimizer step, one sync issues {expected}")

    def hook_engine(self) -> float:
        # an engine that decides in forward whether the coming backward reduces, and reduces during backward
        # (torch DDP's way, lesson 05's OverlapDDP): a forward outside no_sync() makes its backward communicate
        cfg = SHAPES["mlp 16-32-4"]
        expected = self._one_sync_count(_hook_engine, _model(lambda: ToyModel(**cfg)), sync_backward=True)
        want, _ = self.run(cfg, None)
        got, counts = self.run(cfg, self.fn, _hook_engine)
        if any(c > expected for c in counts):
            raise Mismatch(f"{max(counts)} collectives per optimizer step, one synchronised backward issues "
                           f"{expected}: a micro-batch's forward ran outside no_sync()")
        if any(c < expected for c in counts):
            raise Mismatch(f"{min(counts)} collectives in an optimizer step, one synchronised backward issues "
                           f"{expected}: every forward ran inside no_sync(), so no backward reduced (a sync "
                           "afterwards has nothing armed)")
        try:
            return max_diff(got, want, what=f"after {STEPS} steps: ")
        except Mismatch as e:
            raise Mismatch(f"{e}: the one synchronised backward must be the last micro-batch's (a backward that "
                           "synchronises early leaves the later micro-batches unreduced)", e.diff) from None


def _diagnose(got: dict | None, want: dict | None, accum: int, e: Mismatch) -> None:
    """Raise a Mismatch naming the usual mistake when the first step's gradients are `accum` x the big batch's."""
    if not got or not want or set(got) != set(want):
        return
    if all(torch.allclose(got[k], accum * want[k], atol=1e-6) for k in want):
        raise Mismatch(f"the gradients are {accum}x the big batch's: each micro-batch's loss was not divided by "
                       f"their number ({accum}); {e}", e.diff) from None


def _hook_engine(module):
    """Lesson 05's OverlapDDP (it reduces during backward, armed by a forward outside no_sync), under lesson 02's
    name for the sync: `sync_gradients()` is `finish_gradient_synchronization()`."""
    from ddp_lib.ddp import OverlapDDP

    class HookEngine(OverlapDDP):
        def sync_gradients(self) -> None:
            self.finish_gradient_synchronization()

    return HookEngine(module)
