"""Lesson 08's checkers on 2 gloo ranks: the package's pieces pass, stubs read "not written yet", and planted
mistakes fail the property named for them."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.launch import spawn


def all_gather(out, inp):
    """torch 2.13's name, written as a learner on it would; the older name on older torch (the floor is 2.4).
    Looked up at each call, where the checker's guard has replaced it."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, inp)


def reduce_scatter(out, inp):
    """As `all_gather`: torch 2.13's reduce_scatter_single, else reduce_scatter_tensor."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, inp)


def _gather_fns():
    ws = dist.get_world_size()

    class Right(torch.autograd.Function):
        @staticmethod
        def forward(ctx, shard, numel, shape):
            ctx.numel = numel
            buf = torch.empty(shard.numel() * ws)
            all_gather(buf, shard)
            return buf[:numel].view(shape)

        @staticmethod
        def backward(ctx, grad):
            flat = F.pad(grad.reshape(-1), (0, -ctx.numel % ws))
            out = torch.empty(flat.numel() // ws)
            reduce_scatter(out, flat)
            return out / ws, None, None

    class NoDivide(Right):
        @staticmethod
        def backward(ctx, grad):
            return Right.backward(ctx, grad)[0] * ws, None, None

    class AllReduce(Right):  # the right values, through an all-reduce and a slice
        @staticmethod
        def backward(ctx, grad):
            flat = F.pad(grad.reshape(-1), (0, -ctx.numel % ws))
            dist.all_reduce(flat)
            return flat.chunk(ws)[dist.get_rank()] / ws, None, None

    class Stub(Right):
        @staticmethod
        def forward(ctx, shard, numel, shape):
            raise NotImplementedError("your turn")

    return {"right": Right, "no divide": NoDivide, "all-reduce": AllReduce, "stub": Stub}


def _hooks(kind):
    def make(live, gather):
        def pack(t):
            k = live.get(t.untyped_storage().data_ptr())
            if k is None or kind == "keeps weights":
                return t
            return k, t.shape, t.stride(), t.storage_offset()

        def unpack(p):
            if isinstance(p, torch.Tensor):
                return p
            if kind == "stub":
                raise NotImplementedError("your turn")
            k, shape, stride, offset = p
            full = gather(k)
            return full if kind == "no view" else full.as_strided(shape, stride, offset)
        return pack, unpack
    return make


def run_checkers() -> dict:
    from ddp_lib.check.fsdp import check_fsdp, check_gather_scatter_fn, check_saved_tensor_hooks
    from ddp_lib.fsdp import FSDP
    from ddp_lib.fsdp.unit_group import UnitGroup, UnitState

    class Keeps(UnitGroup):
        def reshard(self):  # never lets a gathered weight go
            if self.state is UnitState.UNSHARDING:
                self.wait_for_unshard()

    class KeepsWeights(FSDP):
        UnitGroup = Keeps

    class Sums(UnitGroup):
        def wait_reduce_scatter(self):  # folds the sum over ranks, not the average
            dp, self.ctx.dp_size = self.ctx.dp_size, 1
            try:
                super().wait_reduce_scatter()
            finally:
                self.ctx.dp_size = dp

    class NoAverage(FSDP):
        UnitGroup = Sums

    class Stub(FSDP):
        def __init__(self, module, compute_dtype=None):
            raise NotImplementedError("your turn")

    out = {}
    for name, fn in _gather_fns().items():
        res = check_gather_scatter_fn(fn, timeout_s=20)
        out[f"gather {name}"] = (res.failed, [r.status for r in res.rows])
    for kind in ("right", "keeps weights", "no view", "stub"):
        res = check_saved_tensor_hooks(_hooks(kind), timeout_s=20)
        out[f"hooks {kind}"] = (res.failed, [r.status for r in res.rows])
    for name, cls in (("right", FSDP), ("keeps", KeepsWeights), ("no average", NoAverage), ("stub", Stub)):
        res = check_fsdp(cls, timeout_s=20)
        out[f"fsdp {name}"] = (res.failed, [r.status for r in res.rows])
    return out


def test_fsdp_checkers():
    res = spawn(run_checkers, world_size=2, backend="gloo", timeout_s=240)
    for rank in res:
        assert rank["gather right"][0] == []
        assert rank["gather no divide"][1] == ["PASS", "FAIL", "not checked"]  # calls wait for the values
        assert rank["gather all-reduce"][0] == ["one all-gather forward, one reduce-scatter backward"]
        assert rank["gather stub"][1][0] == "not written yet"
        assert set(rank["gather stub"][1]) <= {"not written yet", "not checked"}
        assert rank["hooks right"][0] == []
        assert rank["hooks keeps weights"][0] == ["weights freed between forward and backward"]
        assert "gradients equal one process" in rank["hooks no view"][0]
        assert rank["hooks stub"][1][0] == "not written yet"
        assert set(rank["hooks stub"][1]) <= {"not written yet", "not checked"}
        assert rank["fsdp right"][0] == []
        assert "holds shards, frees full weights" in rank["fsdp keeps"][0]
        assert rank["fsdp no average"][1] == ["FAIL", "not checked"]  # the memory check waits for the values
        assert rank["fsdp stub"][1][0] == "not written yet"
        assert set(rank["fsdp stub"][1]) <= {"not written yet", "not checked"}
