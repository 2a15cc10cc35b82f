"""check_engine: a DDP wrapper class against the engine contract of DESIGN.md (lessons 02-05)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.check._collective_guard import CollectiveMismatch
from ddp_lib.check._runner import (CheckResult, Mismatch, Property, Refusal, collectives, learner_namespaces,
                                   max_diff, run_check)
from ddp_lib.devices import comm_device, needs_process_group
from ddp_lib.kit.data import shard_batch
from ddp_lib.kit.models import FrozenModel, MixedDtypeModel, TiedModel, ToyModel, UnusedBranchModel

STEPS = 3
ACCUM = 4
# the property cases: the same models, batches and learning rate serve these checks and the test suite
GLOBAL_BATCH = 24  # splits evenly over 2 and 3 ranks and into 4 micro-batches on each
LR = 0.1


def make_model(name: str, seed: int):
    """Model `name` initialised from `seed`."""
    torch.manual_seed(seed)
    if name == "mixed":  # fp32 and fp64 alternate: mixed dtypes, yet exact enough to compare at 1e-5
        return MixedDtypeModel(n_layers=4, dtypes=(torch.float32, torch.float64))
    if name == "mlp":
        return ToyModel(in_dim=16, hidden=32, out_dim=4, depth=2)
    return {"frozen": FrozenModel, "tied": TiedModel, "unused": UnusedBranchModel}[name]()


def make_batch(name: str, step: int):
    """The global batch of `step` (same on every rank and in the single-process reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    if name == "tied":
        return torch.randint(0, 50, (GLOBAL_BATCH, 6), generator=g), torch.randint(0, 50, (GLOBAL_BATCH,), generator=g)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)


def state(model) -> dict[str, torch.Tensor]:
    """A detached copy of `model`'s state dict."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _on_device(model_name: str, seed: int):
    return make_model(model_name, seed).to(comm_device())


def _batch(model_name: str, step: int):
    return tuple(t.to(comm_device()) for t in make_batch(model_name, step))


def _reference(model_name: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = _on_device(model_name, 0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = _batch(model_name, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return state(model)


def _reference_grads(model_name: str) -> dict[str, torch.Tensor]:
    """The first step's gradients of one process on the full batch."""
    model = _on_device(model_name, 0)
    x, y = _batch(model_name, 0)
    F.cross_entropy(model(x), y).backward()
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _diagnose(got: dict, want: dict, ws: int, e: Mismatch) -> None:
    """Raise a Mismatch naming the usual mistake when the first step's gradients are a multiple of the mean."""
    if ws == 1 or set(got) != set(want):
        return
    for factor, what in ((ws, f"gradients are {ws}x the average: summed, not divided by the world size"),
                         (1 / ws, f"gradients are the average / {ws}: divided twice? (divide once)")):
        if all(torch.allclose(got[k].double(), factor * want[k].double(), atol=1e-6) for k in want):
            raise Mismatch(f"{what}; {e}", e.diff) from None


def _train(make, model_name: str, accumulate: int = 1) -> tuple[dict, list[int], dict]:
    """`STEPS` steps of `make(model)` on this rank's shards, `accumulate` micro-batches each (all but the last inside
    `no_sync()`); the final state, the collectives issued inside `no_sync()` per step, the first step's gradients."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _on_device(model_name, 0)
    ddp = make(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inside = []
    first_grads = {}
    for step in range(STEPS):
        x, y = (shard_batch(t, rank, ws) for t in _batch(model_name, step))
        opt.zero_grad(set_to_none=step % 2 == 0)
        n = 0
        for xs, ys, last in zip(x.chunk(accumulate), y.chunk(accumulate), [False] * (accumulate - 1) + [True]):
            if last:
                (F.cross_entropy(ddp(xs), ys) / accumulate).backward()
            else:
                n0 = len(collectives())
                with ddp.no_sync():
                    (F.cross_entropy(ddp(xs), ys) / accumulate).backward()
                n += len(collectives()) - n0
        ddp.finish_gradient_synchronization()
        if step == 0:
            first_grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        inside.append(n)
    return state(model), inside, first_grads


def _unused_branch(make) -> float:
    """The largest gradient difference, over `STEPS` steps, with one process on the full batch when only the last
    rank's shard runs the model's sometimes-used branch."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    model = _on_device("unused", 0)
    ddp = make(model)
    ref_model = _on_device("unused", 0)  # one process, the full batch: the last rank's shard runs the branch
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    worst = 0.0
    for step in range(STEPS):
        x, y = (shard_batch(t, rank, ws) for t in _batch("unused", step))
        opt.zero_grad()
        F.cross_entropy(ddp(x, use_sometimes=rank == ws - 1), y).backward()
        ddp.finish_gradient_synchronization()
        got = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        x, y = _batch("unused", step)
        cut = x.shape[0] // ws * (ws - 1)
        ref_opt.zero_grad()
        F.cross_entropy(torch.cat([ref_model(x[:cut]), ref_model(x[cut:], use_sometimes=True)]), y).backward()
        want = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in ref_model.named_parameters()}
        worst = max(worst, max_diff(got, want, what=f"step {step}, grad of "))
        opt.step()
        ref_opt.step()
    return worst


@needs_process_group
def check_engine(cls: type, timeout_s: float | None = None, **kwargs) -> CheckResult:
    """`cls(module, **kwargs)` follows the engine contract: the same training as one process on the full batch.

    The contract: `ddp = cls(module, **kwargs)`; `loss_fn(ddp(x), y).backward()`;
    `ddp.finish_gradient_synchronization()` leaves every rank with the rank-averaged gradients;
    forward *and* backward inside `with ddp.no_sync():` only accumulate locally (no collective);
    construction makes the replicas equal (broadcast from rank 0), or refuses with an exception on
    every rank; a parameter without a gradient on one rank contributes zeros and never hangs; tied
    parameters count once and frozen ones stay frozen. Models are built and batches sharded by the
    checker; the optimizer steps `module.parameters()`.
    """
    c = _EngineCheck(cls, kwargs)
    props = [
        Property("replicas start equal", c.starts_equal,
                 "broadcast rank 0's parameters (frozen ones too) and buffers at construction"),
        Property("equal to one process", c.equal_one_process,
                 "in finish_gradient_synchronization() divide every trainable grad by the world size once, then "
                 "all-reduce it (divide first, as lesson 04 does: a sum of averages cannot overflow)",
                 needs=("replicas start equal",)),
        Property("no_sync silent (= big batch)", c.no_sync_silent,
                 "inside no_sync() skip communication; the next synchronised backward reduces the accumulated sum",
                 needs=("equal to one process",)),
        Property("unused parameter", c.unused,
                 "a parameter without .grad on one rank still takes part (zeros), or the other rank waits",
                 needs=("equal to one process",)),
        Property("tied and frozen params", c.tied_frozen,
                 "reduce a tied parameter once (module.parameters() yields it once); skip requires_grad=False",
                 needs=("equal to one process",)),
    ]
    return run_check("check_engine", props, timeout_s, learner_namespaces(cls))


class _EngineCheck:
    """The setup (the learner's class and arguments, this rank) and one method per property's evidence."""

    def __init__(self, cls: type, kwargs: dict) -> None:
        self.cls, self.kwargs = cls, kwargs
        self.rank, self.ws = dist.get_rank(), dist.get_world_size()
        self.first_grads: dict[str, torch.Tensor] = {}  # of the last training run's first step, for the diagnosis

    def make(self, model):
        """The learner's engine around `model`."""
        return self.cls(model, **self.kwargs)

    def train(self, model_name: str, accumulate: int = 1) -> tuple[dict, list[int]]:
        """`_train` with the learner's engine; keeps the first step's gradients for the diagnosis."""
        got, inside, self.first_grads = _train(self.make, model_name, accumulate)
        return got, inside

    def starts_equal(self) -> float:
        """Replicas built from different seeds are equal after construction, or every rank refuses."""
        model = _on_device("frozen", 0 if self.rank == 0 else 17 * self.rank)  # frozen weights must be copied too
        try:
            self.make(model)
        except (NotImplementedError, CollectiveMismatch):  # not written yet / desynchronised: not a refusal
            raise
        except Exception as e:  # noqa: BLE001 - a refusal is right only if every rank refuses
            raise Refusal(f"{type(e).__name__}: {str(e)[:120]}") from None
        return max_diff(state(model), state(_on_device("frozen", 0)), tol=0.0,
                        what="after construction, replicas from different seeds: ")

    def equal_one_process(self) -> float:
        """`STEPS` steps equal one process on the full batch (mlp, mixed dtypes)."""
        worst = 0.0
        for name in ("mlp", "mixed"):
            got = self.train(name)[0]
            try:
                worst = max(worst, max_diff(got, _reference(name), what=f"{name}, after {STEPS} steps: "))
            except Mismatch as e:
                _diagnose(self.first_grads, _reference_grads(name), self.ws, e)
                raise
        return worst

    def no_sync_silent(self) -> float:
        """No collective inside no_sync(), and accumulation equals the big batch."""
        got, inside = self.train("mlp", accumulate=ACCUM)
        if any(inside):
            raise Mismatch(f"{max(inside)} collective(s) inside no_sync() in one optimizer step")
        return max_diff(got, _reference("mlp"), what=f"accumulating {ACCUM} micro-batches: ")

    def unused(self) -> float:
        """A branch only the last rank runs: gradients still equal one process."""
        return _unused_branch(self.make)

    def tied_frozen(self) -> float:
        """Tied and frozen parameters: training equals one process."""
        return max(max_diff(self.train(name)[0], _reference(name), what=f"{name}, after {STEPS} steps: ")
                   for name in ("tied", "frozen"))
