"""Every engine's join() on uneven inputs against single-process training on the union of the data (2 and 3 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP
from ddp_lib.launch import spawn

B, LR = 4, 0.1
# (batches per rank, bucket cap MB, divide_by_initial_world_size, micro-batches per step)
CASES = {
    2: [((3, 1), 25.0, False, 1), ((2, 4), 1e-9, False, 1), ((3, 1), 1e-9, True, 1), ((0, 2), 1e-3, False, 1),
        ((1, 3), 1e-3, False, 2)],
    3: [((2, 4, 1), 1e-9, False, 1), ((3, 0, 3), 25.0, False, 1), ((1, 1, 3), 1e-3, True, 1)],
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch(case: int, rank: int, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * case + 100 * rank + 10 * step + micro)
    return torch.randn(B, 6, generator=g), torch.randn(B, 2, generator=g)


ENGINES = {"bucketed": lambda m, mb: BucketedDDP(m, bucket_size_mb=mb, first_bucket_mb=mb),
           "naive": lambda m, mb: NaiveDDP(m), "flat": lambda m, mb: FlatDDP(m), "overlap": lambda m, mb: OverlapDDP(m)}


def _train_case(engine: str, i: int, counts, mb: float, by_initial: bool, micro: int) -> list[torch.Tensor]:
    model = _model()
    ddp = ENGINES[engine](model, mb)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with ddp.join(divide_by_initial_world_size=by_initial):
        for step in range(counts[dist.get_rank()]):
            opt.zero_grad()
            for m in range(micro):  # the first micro-batches only accumulate; the last synchronizes
                x, y = _batch(i, dist.get_rank(), step, m)
                if m < micro - 1:
                    with ddp.no_sync():
                        (nn.functional.mse_loss(ddp(x), y) / micro).backward()
                else:
                    (nn.functional.mse_loss(ddp(x), y) / micro).backward()
            ddp.finish_gradient_synchronization()
            opt.step()
    # after join the engine trains on as usual (every rank has data again)
    opt.zero_grad()
    x, y = _batch(i, dist.get_rank(), 99)
    nn.functional.mse_loss(ddp(x), y).backward()
    ddp.finish_gradient_synchronization()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _run() -> dict[str, dict[int, list[torch.Tensor]]]:
    ws = dist.get_world_size()
    cases = {e: range(len(CASES[ws])) if e == "bucketed" else OTHERS[ws] for e in ENGINES}
    return {e: {i: _train_case(e, i, *CASES[ws][i]) for i in cases[e]} for e in ENGINES}


def reference(i: int, counts, by_initial: bool, micro: int) -> list[torch.Tensor]:
    """One process: each step averages the per-rank losses of the ranks that still have data."""
    ws = len(counts)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(max(counts)):
        active = [r for r in range(ws) if counts[r] > step]
        opt.zero_grad()
        loss = sum(nn.functional.mse_loss(model(x), y) / micro
                   for r in active for x, y in (_batch(i, r, step, m) for m in range(micro)))
        (loss / (ws if by_initial else len(active))).backward()
        opt.step()
    opt.zero_grad()
    (sum(nn.functional.mse_loss(model(x), y) for x, y in (_batch(i, r, 99) for r in range(ws))) / ws).backward()
    opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.fixture(scope="module")
def runs():
    return {ws: spawn(_run, world_size=ws, timeout_s=300) for ws in CASES}


# every case for the bucketed engine (its bucket rebuild joins the shadow step); for the others, whose shadow step
# is the front's, one case per kind: 2 ranks, 2 ranks with micro-batches, 3 ranks with a rank that has no data
OTHERS = {2: (0, 4), 3: (1,)}
PAIRS = [("bucketed", ws, i) for ws in CASES for i in range(len(CASES[ws]))] + \
        [(e, ws, i) for e in ENGINES if e != "bucketed" for ws, cases in OTHERS.items() for i in cases]


@pytest.mark.parametrize("engine,ws,i", PAIRS)
def test_join_matches_union_training(runs, ws, i, engine):
    counts, _, by_initial, micro = CASES[ws][i]
    want = reference(i, counts, by_initial, micro)
    for rank, result in enumerate(runs[ws]):
        got_case = result[engine][i]
        for k, (got, exp) in enumerate(zip(got_case, want)):
            err = (got - exp).abs().max().item()
            assert err < 1e-5, f"{engine} ws{ws} case {CASES[ws][i]}: rank {rank} parameter {k} off by {err:.3g}"
        assert all(torch.equal(a, b) for a, b in zip(got_case, runs[ws][0][engine][i])), f"rank {rank} differs"


def test_reference_depends_on_the_division():
    """The two divisions give different models: the by-initial cases test something."""
    a = reference(0, (3, 1), False, 1)
    b = reference(0, (3, 1), True, 1)
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) > 1e-4
