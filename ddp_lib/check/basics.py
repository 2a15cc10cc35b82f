"""Checkers of lesson 02: gradient averaging and seed verification (and helpers lesson 03's checker shares)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib.check._runner import (CheckResult, Mismatch, Property, collectives, learner_namespaces, max_diff,
                                   run_check)
from ddp_lib.kit.data import shard_batch
from ddp_lib.devices import comm_device, needs_process_group
from ddp_lib.kit.models import FrozenModel, ToyModel, UnusedBranchModel

BATCH = 24  # the global batch: splits over 1, 2, 3, 4, 6 and 8 ranks
STEPS = 3
LR = 0.1
SHAPES = {"mlp 16-32-4": dict(in_dim=16, hidden=32, out_dim=4, depth=2),
          "mlp 16-24-4 x3": dict(in_dim=16, hidden=24, out_dim=4, depth=3)}


def _rank_ws() -> tuple[int, int]:
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _model(make: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return make().to(comm_device())


def _batch(step: int, n: int = BATCH, in_dim: int = 16, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    dev = comm_device()
    return torch.randn(n, in_dim, generator=g).to(dev), torch.randint(0, classes, (n,), generator=g).to(dev)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters() if p.requires_grad}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _explain_grads(got: dict, want: dict, local: dict, ws: int) -> None:
    """Raise a Mismatch that names the usual mistake when `got` is not `want`."""
    try:
        max_diff(got, want, what="grad of ")
    except Mismatch as e:
        if ws > 1 and all(torch.allclose(got[k], ws * want[k], atol=1e-5) for k in want):
            raise Mismatch(f"gradients are {ws}x the average: summed, not divided by the world size", e.diff)
        if ws > 1 and all(torch.allclose(got[k], want[k] / ws, atol=1e-6) for k in want):
            raise Mismatch(f"gradients are the average / {ws}: divided twice? (divide once, before or after "
                           "the all-reduce)", e.diff)
        if all(torch.allclose(got[k], local[k], atol=1e-7) for k in want):
            raise Mismatch("gradients are this rank's own: nothing was averaged", e.diff)
        raise


# ---------------------------------------------------------------------------------------------- check_sync
@needs_process_group
def check_sync(fn: Callable[[nn.Module], int | None], timeout_s: float | None = None,
               returns_calls: bool = False) -> CheckResult:
    """`fn(model)` averages `model`'s gradients across ranks in place (lesson 02's `sync_gradients`).

    After `fn(model)` every trainable parameter's `.grad` must be the mean over ranks of the local
    gradients (each rank computed it on its shard of the batch), the weights must be untouched,
    frozen parameters (`requires_grad=False`, `.grad` None) must be left alone, and a parameter whose
    `.grad` is None on one rank only must still take part (as zeros) instead of hanging the others.
    `returns_calls=True` (lesson 04's `naive_sync`/`flat_sync`): `fn` also returns the number of all-reduce
    calls it issued, which is compared with the all-reduces the check saw it issue. The order of the division
    (before or after the all-reduce) is not checked: in float32 both give the mean of these gradients (lesson 09's
    `check_compression_hook` refuses the order that overflows in fp16).
    """
    s = _Sync(fn)
    props = [
        Property("weights untouched", s.weights_untouched,
                 "reduce p.grad, not p or p.data: the weights are already equal, the gradients are not"),
        Property("grads averaged (= one process)", s.averaged,
                 "all_reduce (SUM) each p.grad and divide it by world_size exactly once (lesson 04 divides first, "
                 "lesson 02 after: either gives the mean)", needs=("weights untouched",)),
        Property("frozen params skipped", s.frozen,
                 "skip parameters with requires_grad=False: their grad is None and must stay None",
                 needs=("grads averaged (= one process)",)),
        Property("grad None on one rank", s.missing_grad,
                 "a None grad must still take part, as zeros: a rank that skips it leaves the others waiting",
                 needs=("grads averaged (= one process)",)),
    ]
    if returns_calls:
        props.append(Property("returns its all-reduce count", s.counted,
                              "return how many times dist.all_reduce ran (frozen parameters make no call); "
                              "the engines report it as comm_calls", needs=("grads averaged (= one process)",)))
    return run_check("check_sync", props, timeout_s, learner_namespaces(fn))


class _Sync:
    """The setup (this rank, the world size, the learner's fn) and one method per property's evidence."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.rank, self.ws = _rank_ws()

    def train(self, cfg: dict, synced: bool) -> tuple[dict, dict, dict]:
        model = _model(lambda: ToyModel(**cfg))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        first = None
        for step in range(STEPS):
            x, y = _batch(step, in_dim=cfg["in_dim"], classes=cfg["out_dim"])
            if synced:
                x, y = shard_batch(x, self.rank, self.ws), shard_batch(y, self.rank, self.ws)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if synced:
                local = _grads(model)
                self.fn(model)
                if first is None:
                    first = (_grads(model), local)
            elif first is None:
                first = (_grads(model), None)
            opt.step()
        return _params(model), *first

    def averaged(self) -> float:
        worst = 0.0
        for name, cfg in SHAPES.items():
            want_p, want_g, _ = self.train(cfg, synced=False)
            got_p, got_g, local = self.train(cfg, synced=True)
            _explain_grads(got_g, want_g, local, self.ws)
            worst = max(worst, max_diff(got_p, want_p, what=f"{name}, after {STEPS} steps: "))
        return worst

    def weights_untouched(self) -> float:
        # replicas that differ on purpose: averaging them (the mistake) would change them
        model = _model(lambda: ToyModel(**SHAPES["mlp 16-32-4"]), seed=10 + self.rank)
        x, y = _batch(0)
        F.cross_entropy(model(shard_batch(x, self.rank, self.ws)), shard_batch(y, self.rank, self.ws)).backward()
        before = _params(model)
        self.fn(model)
        return max_diff(_params(model), before, tol=0.0, what="weight ")

    def frozen(self) -> float:
        model = _model(FrozenModel)
        x, y = _batch(0)
        F.cross_entropy(model(shard_batch(x, self.rank, self.ws)), shard_batch(y, self.rank, self.ws)).backward()
        self.fn(model)
        bad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        if bad:
            raise Mismatch(f"frozen {bad[0]} was given a gradient")
        ref = _model(FrozenModel)
        F.cross_entropy(ref(x), y).backward()
        return max_diff(_grads(model), _grads(ref), what="grad of ")

    def missing_grad(self) -> float:
        model = _model(UnusedBranchModel)
        x, y = _batch(0)
        F.cross_entropy(model(shard_batch(x, self.rank, self.ws), use_sometimes=self.rank == self.ws - 1),
                        shard_batch(y, self.rank, self.ws)).backward()
        self.fn(model)
        ref = _model(UnusedBranchModel)  # the full batch; the last rank's shard runs the extra branch
        half = x.shape[0] // self.ws * (self.ws - 1)
        out = torch.cat([ref(x[:half]), ref(x[half:], use_sometimes=True)])
        F.cross_entropy(out, y).backward()
        return max_diff(_grads(model), _grads(ref), what="grad of ")

    def counted(self) -> None:
        model = _model(FrozenModel)  # frozen parameters: they take no part, so they are not counted
        x, y = _batch(0)
        F.cross_entropy(model(shard_batch(x, self.rank, self.ws)), shard_batch(y, self.rank, self.ws)).backward()
        n0 = len(collectives())
        returned = self.fn(model)
        issued = sum(1 for c in collectives()[n0:] if c == "all_reduce")
        if returned is None:
            raise Mismatch(f"returned None; it issued {issued} all-reduce call(s): return that count")
        if returned != issued:
            raise Mismatch(f"returned {returned!r}, but issued {issued} all-reduce call(s)")


# --------------------------------------------------------------------------------- check_seed_verification
@needs_process_group
def check_seed_verification(fn: Callable[[nn.Module], None], timeout_s: float | None = None) -> CheckResult:
    """`fn(model)` returns when every rank's parameters equal rank 0's, else raises ValueError on *every* rank.

    The contract of lesson 02's `SimpleDistributedDataParallelism` (which calls it at construction):
    compare every value of every parameter exactly with rank 0's; agree on the verdict across ranks (a rank
    that raised alone would leave the others waiting in their next collective); never modify the
    parameters (verifying is not broadcasting: a refusal tells the learner to fix the seed).
    """
    v = _SeedVerification(fn)
    return run_check("check_seed_verification", [
        Property("equal replicas accepted", v.equal, "compare with rank 0's parameters, not with a fresh model"),
        Property("different seeds refused on every rank", v.seeds,
                 "agree on the verdict (all_reduce a mismatch count) so that every rank raises, not only the odd one",
                 needs=("equal replicas accepted",)),
        Property("swapped values found", v.swapped,
                 "compare every value of every parameter, not a checksum or a sample: a sum (or a max) of the "
                 "parameters is blind to values that trade places", needs=("different seeds refused on every rank",)),
        Property("one differing value found", v.one_value,
                 "compare every parameter and every value exactly (torch.equal, which compares values: +0.0 equals "
                 "-0.0; comparing the bytes tells those apart too): torch.allclose or a sample lets a replica that "
                 "differs in one value through", needs=("swapped values found",)),
    ], timeout_s, learner_namespaces(fn))


class _SeedVerification:
    """The setup (the learner's fn, this rank) and one method per property's evidence."""

    def __init__(self, fn: Callable[[nn.Module], None]) -> None:
        self.fn = fn
        self.rank, self.ws = _rank_ws()

    def make(self, seed: int) -> nn.Module:
        return _model(lambda: ToyModel(**SHAPES["mlp 16-24-4 x3"]), seed)

    def expect_refusal(self, model: nn.Module, how: str = "") -> float:
        before = _params(model)
        try:
            self.fn(model)
        except ValueError:
            return max_diff(_params(model), before, tol=0.0, what="verification changed ")
        raise Mismatch(f"rank {self.rank} accepted replicas that differ{how} (no ValueError here)")

    def equal(self) -> float:
        model = self.make(0)
        before = _params(model)
        self.fn(model)
        return max_diff(_params(model), before, tol=0.0, what="verification changed ")

    def seeds(self) -> float | None:
        if self.ws == 1:
            return None  # one replica cannot differ from itself
        return self.expect_refusal(self.make(1000 + self.rank))

    def one_value(self) -> float | None:
        if self.ws == 1:
            return None
        model = self.make(0)
        # the last value of the last parameter, one float32 step away: allclose calls it equal
        if self.rank == self.ws - 1:
            with torch.no_grad():
                v = list(model.parameters())[-1].view(-1)
                v[-1] = torch.nextafter(v[-1], torch.tensor(float("inf"), dtype=v.dtype, device=v.device))
        return self.expect_refusal(model, f" (rank {self.ws - 1}: one value one float32 step away)")

    def swapped(self) -> float | None:
        if self.ws == 1:
            return None
        model = self.make(0)
        with torch.no_grad():  # exact binary fractions: any sum, in any order, is the same on every rank
            bias = list(model.parameters())[-1]
            bias.copy_(torch.tensor([2.0 ** -k for k in range(1, bias.numel() + 1)], dtype=bias.dtype))
            if self.rank == self.ws - 1:
                bias[[0, 1]] = bias[[1, 0]]  # two values swapped: same sum, same max, different parameter
        return self.expect_refusal(model, f" (rank {self.ws - 1}: two values swapped, the same sum)")
