"""The DDP engines are one front (`ddp_lib/contract.py`) and a small strategy: shallow classes, few attributes (FSDP and
its parts too), and a bucket rebuild that frees the old buffers before it allocates the new ones."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
import torch.nn as nn

from ddp_lib.contract import DataParallelWrapper
from ddp_lib.ddp import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP
from ddp_lib.ddp import bucket as bucket_module
from ddp_lib.fsdp import FSDP
from ddp_lib.launch import spawn

ENGINES = (NaiveDDP, FlatDDP, OverlapDDP, BucketedDDP)
MAX_ATTRIBUTES = 20


def _package_bases(cls: type) -> list[type]:
    """`cls`'s ancestors defined in ddp_lib (nn.Module and object are torch's and Python's)."""
    return [c for c in cls.__mro__[1:] if c.__module__.startswith("ddp_lib")]


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_an_engine_inherits_one_level_and_its_strategy_one(cls):
    assert _package_bases(cls) == [DataParallelWrapper], cls.__mro__


def _attributes() -> dict:
    """Rank body: the attributes each engine and its strategy, and FSDP and its parts, set on themselves (nn.Module's
    own excluded)."""
    module_own = set(vars(nn.Module()))
    out = {}
    for cls in ENGINES:
        ddp = cls(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)))
        for _ in range(2):  # the bucket rebuild happens at the second synchronizing forward
            ddp(torch.randn(4, 8)).sum().backward()
            ddp.finish_gradient_synchronization()
        out[cls.__name__] = sorted(set(vars(ddp)) - module_own)
        out[cls.__name__ + ".sync"] = sorted(vars(ddp.sync))
        out[cls.__name__ + ".bases"] = [c.__name__ for c in _package_bases(type(ddp.sync))]
    fsdp = FSDP(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)), compute_dtype=torch.bfloat16)
    with fsdp.no_sync():  # every path that may set state late: no_sync, a synchronized step, the collective methods
        fsdp(torch.randn(4, 8)).sum().backward()
    fsdp(torch.randn(4, 8)).sum().backward()
    fsdp.clip_grad_norm_(1.0)
    fsdp.state_dict()
    out["FSDP"] = sorted(set(vars(fsdp)) - module_own)
    for part in ("_comm", "_layout", "_schedule", "_guards", "_states"):
        out[f"FSDP.{part}"] = sorted(vars(getattr(fsdp, part)))
    for u in fsdp._layout.unique:
        out[f"FSDP UnitGroup {u.name}"] = sorted(vars(u))
    return out


def test_no_engine_fsdp_or_their_parts_hold_over_20_attributes_and_strategies_inherit_one_level():
    out = spawn(_attributes, world_size=2)[0]
    assert "FSDP" in out and any(name.startswith("FSDP UnitGroup") for name in out)
    for name, attrs in out.items():
        if name.endswith(".bases"):
            assert attrs == ["SyncStrategy"], (name, attrs)
        else:
            assert len(attrs) <= MAX_ATTRIBUTES, (name, len(attrs), attrs)


class Chain(nn.Module):
    """Four square layers run in `order`: a different order makes the bucket rebuild change the plan."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.order = [1, 0, 3, 2]

    def forward(self, x):
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return x


def _rebuild(set_to_none: bool, no_sync_step: bool) -> dict:
    """Rank body: one step, then the forward that rebuilds the buckets; how many old buffers were still alive when
    each new one was allocated, and whether the step after still averages correctly."""
    torch.manual_seed(0)
    model = Chain()
    ddp = BucketedDDP(model, bucket_size_mb=0.03, first_bucket_mb=0.03)  # 2 buckets of 2 layers
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64) + torch.distributed.get_rank()
    ddp(x).sum().backward()
    ddp.finish_gradient_synchronization()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    if no_sync_step:  # gradients accumulated locally, to carry into the new buckets
        with ddp.no_sync():
            ddp(x).sum().backward()
    old = [weakref.ref(b.buffer) for b in ddp.buckets]
    before = [[id(p) for p in b.params] for b in ddp.buckets]
    plain = copy.deepcopy(model)  # the gradients by hand: the local ones (twice after a no_sync step), averaged
    for _ in range(2 if no_sync_step else 1):
        plain(x).sum().backward()
    want = [p.grad for p in plain.parameters()]
    for g in want:
        torch.distributed.all_reduce(g)
        g.div_(2)
    alive_at_alloc = []
    real_zeros = bucket_module.torch.zeros

    class Spy:  # bucket.py's `torch`, with zeros() recording the old buffers still alive
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def zeros(*args, **kwargs):
            alive_at_alloc.append(sum(r() is not None for r in old))
            return real_zeros(*args, **kwargs)

    bucket_module.torch = Spy()
    try:
        loss = ddp(x).sum()
    finally:
        bucket_module.torch = torch
    changed = [[id(p) for p in b.params] for b in ddp.buckets] != before
    loss.backward()
    ddp.finish_gradient_synchronization()
    return {"alive": alive_at_alloc, "changed": changed, "rebuilt": ddp.rebuilt,
            "by_hand": all(torch.allclose(p.grad, w, atol=1e-6) for p, w in zip(model.parameters(), want))}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_rebuild_frees_the_old_buffers_before_allocating_the_new_ones(set_to_none):
    """Issue 59: with both sets alive a 1.5B-parameter model needs weights plus two gradient buffers (about
    3 x 5.6 GiB on a 2xT4). No old bucket buffer may be alive when a new one is allocated."""
    rows = spawn(_rebuild, world_size=2, args=(set_to_none, False))
    for r in rows:
        assert r["rebuilt"] and r["changed"], r  # the plan changed, so new buffers were allocated
        assert r["alive"] and all(n == 0 for n in r["alive"]), r["alive"]
        assert r["by_hand"], r


def test_gradients_accumulated_before_the_rebuild_join_the_next_average():
    """A no_sync step before the rebuilding step: its local gradients are carried into the new buckets (their old
    buffers live until copied) and the average equals the one computed by hand."""
    rows = spawn(_rebuild, world_size=2, args=(True, True))
    assert all(r["changed"] and r["by_hand"] for r in rows), rows
