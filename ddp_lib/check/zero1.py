"""check_zero1: a ZeRO-1 optimizer (lesson 07) against the unsharded one, and what state it really holds."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.check._runner import TOL, CheckResult, Mismatch, Property, learner_namespaces, max_diff, run_check
from ddp_lib.devices import comm_device, needs_process_group
from ddp_lib.kit.memory import reachable_tensors
from ddp_lib.kit.models import ManySmallParams, ToyModel

STEPS = 3
#: (model, optimizer class, its kwargs): two shapes, two optimizers (one with two state tensors per parameter)
SETUPS = [
    (lambda: ManySmallParams(dim=16, n_layers=6), torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (lambda: ToyModel(in_dim=16, hidden=24, out_dim=16, depth=3), torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
]


def _train(make, opt_cls, kwargs, cls=None, steps=STEPS):
    torch.manual_seed(0)
    model = make().to(comm_device())
    opt = (cls(model.parameters(), opt_cls, **kwargs) if cls else opt_cls(model.parameters(), **kwargs))
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).to(comm_device())
        model.zero_grad(set_to_none=True)  # the module's, so that a sketch without zero_grad() is checked too
        # every rank computes the full-batch gradient itself: what a DDP wrapper would leave after its sync
        F.mse_loss(model(x), x.flip(0)[:, : model(x).shape[1]]).backward()
        opt.step()
    return model, opt


@needs_process_group
def check_zero1(cls: type, timeout_s: float | None = None) -> CheckResult:
    """`cls(params, optimizer_cls, **kwargs)` is a torch optimizer that keeps only this rank's shard of the state.

    Given gradients already equal on every rank, `step()` must leave every rank with the parameters
    `optimizer_cls` would produce unsharded (AdamW and SGD with momentum are tried); the optimizer
    state found by walking the object's attributes (not what it reports) must be about 1/world_size
    of the full state: at most (numel / world_size + the largest parameter) elements per state tensor kind.
    """
    z = _Zero1(cls)
    return run_check("check_zero1", [
        Property("equal to the unsharded optimizer", z.equal,
                 "step only your shard, then every rank loops over the owners in the same order: flatten what src "
                 "owns, dist.broadcast it from src, copy the values back into the parameters"),
        Property("state is this rank's shard only", z.sharded,
                 "build the inner optimizer on your shard's parameters only; keep no full optimizer, and no copy "
                 "of every parameter, around", needs=("equal to the unsharded optimizer",)),
    ], timeout_s, learner_namespaces(cls))


class _Zero1:
    """The setup (the learner's class, the world size) and one method per property's evidence."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.ws = dist.get_world_size()

    def first_step(self, make, opt_cls, kwargs) -> None:
        """After one step a mistake in the sharing shows as some parameters right and the others wrong."""
        got = dict(_train(make, opt_cls, kwargs, self.cls, steps=1)[0].named_parameters())
        want = dict(_train(make, opt_cls, kwargs, steps=1)[0].named_parameters())
        start = dict(_train(make, opt_cls, kwargs, steps=0)[0].named_parameters())
        wrong = [n for n in want if (got[n].detach() - want[n].detach()).abs().max().item() > TOL]
        if not wrong:
            return
        stale = [n for n in wrong if torch.equal(got[n].detach(), start[n].detach())]
        diff = max((got[n].detach() - want[n].detach()).abs().max().item() for n in wrong)
        if len(wrong) < len(want):
            why = (f"{len(stale)} of them still hold their initial values (an update that never arrived here)"
                   if stale else "the others hold values no owner computed")
            raise Mismatch(f"{opt_cls.__name__}, after 1 step: {len(wrong)} of {len(want)} parameters differ on this "
                           f"rank, the rest are right; {why}: every owner must broadcast its updated parameters "
                           "(src=owner), and each rank copy them back", diff)
        others = self.ws - 1
        if others and all(torch.allclose(got[n].detach(), want[n].detach() + others * start[n].detach(), atol=1e-5)
                          for n in want):
            raise Mismatch(f"{opt_cls.__name__}, after 1 step: every parameter is the owner's new value plus the "
                           f"{self.ws - 1} other rank(s)' old one: an all-reduce sums the replicas; broadcast from the "
                           "owner", diff)
        raise Mismatch(f"{opt_cls.__name__}, after 1 step: every parameter differs (largest {diff:.1e}): the "
                       "local step, or the sharing, changed what every rank holds", diff)

    def equal(self) -> float:
        worst = 0.0
        for k, (make, opt_cls, kwargs) in enumerate(SETUPS):
            self.first_step(make, opt_cls, kwargs)
            got, _ = _train(make, opt_cls, kwargs, self.cls)
            want, _ = _train(make, opt_cls, kwargs)
            worst = max(worst, max_diff(dict(got.named_parameters()), dict(want.named_parameters()),
                                        what=f"{opt_cls.__name__}, after {STEPS} steps: "))
        return worst

    def sharded(self) -> float | None:
        make, opt_cls, kwargs = SETUPS[0]
        model, opt = _train(make, opt_cls, kwargs, self.cls)
        params = list(model.parameters())
        skip = {id(p) for p in params} | {p.data_ptr() for p in params} | \
            {id(p.grad) for p in params if p.grad is not None} | {p.grad.data_ptr() for p in params if p.grad is not None}
        storages = {}
        for t in reachable_tensors(opt, skip):
            if t.numel() > 1:  # step counters are scalars
                storages[(t.data_ptr(), t.numel())] = t.numel()
        held = sum(storages.values())
        n, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
        full = 2 * n  # AdamW: exp_avg and exp_avg_sq per parameter
        allowed = 2 * (n // self.ws + largest)
        if held == 0:
            raise Mismatch("no optimizer state found in the object's attributes after step()")
        if self.ws > 1 and held > allowed:
            raise Mismatch(f"{held} state elements reachable on this rank; the full state is {full}, "
                           f"a shard at most {allowed}")
        return None
