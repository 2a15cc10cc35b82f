"""BucketedDDP's bucket plan (torch DDP's: a small first bucket, rebuilt in arrival order) and OverlapDDP with
non-contiguous gradients, on 2 gloo ranks against one process on the full batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib.comm import spy_on
from ddp_lib.kit.data import shard_batch
from ddp_lib.ddp import BucketedDDP, OverlapDDP
from ddp_lib.ddp.bucketed import FIRST_BUCKET_MB, assign_buckets
from ddp_lib.launch import spawn

KB = 1024


class DefinedBackwards(nn.Module):
    """`out` is defined before `inp` but used after it: reverse definition order is not backward's order."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.out = nn.Linear(width, width)
        self.inp = nn.Linear(width, width)
        self.mid = nn.Linear(width, width)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))


def _names(model: nn.Module, groups) -> list[list[str]]:
    name = {id(p): n for n, p in model.named_parameters()}
    return [[name[id(p)] for p in g] for g in groups]


def rebuild_case(steps: int = 4) -> dict:
    """Bucket plans before and after the rebuild, arrival order, buffers, and the final parameters."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DefinedBackwards()
    ddp = BucketedDDP(model, bucket_size_mb=5 * KB / 2**20, first_bucket_mb=0.1 * KB / 2**20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plans, ptrs, calls, arrived = [], [], [], []
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen)
        opt.zero_grad(set_to_none=False)
        F.mse_loss(ddp(shard_batch(x, rank, ws)), shard_batch(y, rank, ws)).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        plans.append(_names(model, [b.params for b in ddp.buckets]))
        ptrs.append([b.buffer.data_ptr() for b in ddp.buckets])
        calls.append(ddp.comm_calls)
        arrived.append(_names(model, [[ddp.sync.each[k] for k in ddp.sync.arrivals]])[0])
    return {"plans": plans, "ptrs": ptrs, "calls": calls, "arrived": arrived[0], "rebuilt": ddp.rebuilt,
            "params": torch.cat([p.detach().flatten() for p in model.parameters()])}


def reference_params(steps: int = 4) -> torch.Tensor:
    """One process, the full batch, the same seeds."""
    torch.manual_seed(0)
    model = DefinedBackwards()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 32, generator=gen), torch.randn(8, 32, generator=gen)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def rebuilt():
    return spawn(rebuild_case, world_size=2, backend="gloo", timeout_s=120)


def test_first_bucket_is_torch_default():
    assert FIRST_BUCKET_MB * 2**20 == dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20


def test_first_bucket_small_then_cap():
    """Each 4 KiB weight, 128 B bias: the first bucket closes at 0.1 KiB (one bias), the others at 5 KiB."""
    model = DefinedBackwards()
    params = list(reversed(list(model.parameters())))
    groups = assign_buckets(params, 5 * KB, int(0.1 * KB))
    assert _names(model, groups) == [["mid.bias"], ["mid.weight", "inp.bias", "inp.weight"],
                                     ["out.bias", "out.weight"]]
    # without a first cap, the old plan: every bucket closes at the cap
    assert _names(model, assign_buckets(params, 5 * KB)) == [["mid.bias", "mid.weight", "inp.bias", "inp.weight"],
                                                            ["out.bias", "out.weight"]]
    # a cap smaller than the first bucket's wins (torch: an explicit bucket_cap_mb sets both)
    assert _names(model, assign_buckets(params, 1, 2**20)) == [[n] for n in _names(model, [params])[0]]


def test_plan_before_rebuild_is_reverse_definition_order(rebuilt):
    for r in rebuilt:
        assert r["plans"][0] == [["mid.bias"], ["mid.weight", "inp.bias", "inp.weight"], ["out.bias", "out.weight"]]


def test_rebuilt_in_arrival_order_after_first_step(rebuilt):
    for r in rebuilt:
        assert r["arrived"] == ["out.bias", "out.weight", "mid.bias", "mid.weight", "inp.bias", "inp.weight"]
        assert r["rebuilt"]
        # the arrival order, cut with the same caps: first 0.1 KiB, then 5 KiB
        expected = [["out.bias"], ["out.weight", "mid.bias", "mid.weight"], ["inp.bias", "inp.weight"]]
        assert all(plan == expected for plan in r["plans"][1:]), r["plans"]
        assert all(p == r["ptrs"][1] for p in r["ptrs"][1:]), "buffers persist once rebuilt"
        assert r["calls"] == [3] * len(r["calls"]), "one all-reduce per bucket"
    assert rebuilt[0]["plans"] == rebuilt[1]["plans"]


def test_rebuilt_buckets_train_like_one_process(rebuilt):
    ref = reference_params()
    for r in rebuilt:
        torch.testing.assert_close(r["params"], ref, atol=1e-5, rtol=0)
    assert torch.equal(rebuilt[0]["params"], rebuilt[1]["params"])


class Transposed(nn.Module):
    """A weight that is a transposed view made a Parameter: its gradient is not contiguous."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 6).t())  # (6, 8), strides (1, 6)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(x @ self.w)


def non_contiguous_case(engine: str) -> dict:
    """Three SGD steps of Transposed through `engine`; the final parameters."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Transposed()
    ddp = {"overlap": OverlapDDP, "bucketed": BucketedDDP}[engine](model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    layouts = []
    # gloo reduces a dense strided tensor; NCCL refuses a non-contiguous one
    with spy_on("all_reduce", lambda tensor, *a, **k: layouts.append(tensor.is_contiguous())):
        for _ in range(3):
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
            opt.zero_grad()
            F.mse_loss(ddp(shard_batch(x, rank, ws)), shard_batch(y, rank, ws)).backward()
            ddp.finish_gradient_synchronization()
            opt.step()
    return {"params": torch.cat([p.detach().flatten() for p in model.parameters()]), "layouts": layouts}


@pytest.mark.parametrize("engine", ["overlap", "bucketed"])
def test_non_contiguous_gradient(engine):
    torch.manual_seed(0)
    model = Transposed()
    assert not model.w.is_contiguous()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    expected = torch.cat([p.detach().flatten() for p in ref.parameters()])
    for r in spawn(non_contiguous_case, world_size=2, args=(engine,), backend="gloo", timeout_s=120):
        torch.testing.assert_close(r["params"], expected, atol=1e-5, rtol=0)
        assert r["layouts"] and all(r["layouts"]), "every tensor handed to all_reduce must be contiguous (NCCL)"
