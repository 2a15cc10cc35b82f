"""Everyday sequences that used to break or silently corrupt: re-wrapping, a forgotten finish, buffers,
parameters unused everywhere, mixed dtypes. 2 gloo ranks unless said otherwise."""

from __future__ import annotations

import pytest
import torch

import ddp_habit_cases as H
from ddp_lib.ddp import ENGINES
from ddp_lib.ddp.bucketed import assign_buckets
from ddp_lib.launch import spawn
from ddp_lib.kit.models import MixedDtypeModel

DDP_ENGINES = [e for e in ENGINES if e != "simple"]
HOOK_ENGINES = ["overlap", "bucketed"]
CASES = ([("rewrap", e) for e in DDP_ENGINES] + [("forgotten", e) for e in ENGINES]
         + [("buffers", e, b) for e in DDP_ENGINES for b in (True, False)]
         + [("unused", e) for e in ENGINES] + [("bf16", e) for e in DDP_ENGINES]
         + [("reentrant", e) for e in HOOK_ENGINES] + [("callback", e) for e in HOOK_ENGINES]
         + [("freeze", e) for e in ENGINES] + [("noncontig", e) for e in ENGINES])


@pytest.fixture(scope="module")
def ranks():
    """Every case on 2 ranks in one spawn (starting processes dominates the cost on a small machine)."""
    return spawn(H.run_cases, world_size=2, args=(CASES,), timeout_s=300)


def results(ranks: list[dict], *case) -> list:
    got = [r[case] for r in ranks]
    for g in got:
        if isinstance(g, Exception):
            raise g
    return got


@pytest.mark.parametrize("engine", DDP_ENGINES)
def test_rewrap_detaches_the_old_wrapper(ranks, engine):
    for r in results(ranks, "rewrap", engine):
        want_hooks = 1 if engine in HOOK_ENGINES else 0
        assert r["hooks"] == [want_hooks] * len(r["hooks"]), "the old wrapper's hooks must be removed"
        assert "detached" in r["old_forward"] and "use the new wrapper" in r["old_forward"]
        assert r["freed"], "a detached wrapper must be freed as soon as it is dropped"
        assert r["live_freed"], "hooks must not keep a dropped wrapper alive (no param -> hook -> wrapper cycle)"
        assert r["hooks_after_drop"] == [0] * len(r["hooks"]), "a collected wrapper's hooks are removed"


@pytest.mark.parametrize("engine", list(ENGINES))
def test_forgotten_finish_then_no_sync_step(ranks, engine):
    """sync step without finish, a no_sync step, a sync step: the torch DDP result, never a race."""
    ref = H.forgotten_finish_reference()
    for rank, got in enumerate(results(ranks, "forgotten", engine)):
        if engine in HOOK_ENGINES:  # the first step's all-reduce completed when its backward ended
            for g, want in zip(got["after_no_sync"], ref["after_no_sync"][rank]):
                torch.testing.assert_close(g, want, rtol=0, atol=1e-5)
        assert not isinstance(got["final"], str), got["final"]
        for g, want in zip(got["final"], ref["final"]):
            torch.testing.assert_close(g, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("engine", DDP_ENGINES)
@pytest.mark.parametrize("broadcast", [True, False])
def test_broadcast_buffers(ranks, engine, broadcast):
    steps, momentum = 3, 0.1  # buffers() trains 3 steps; BatchNorm's default momentum
    got = results(ranks, "buffers", engine, broadcast)

    def ema(rank: int, start: torch.Tensor, first: int, last: int) -> torch.Tensor:
        rm = start.clone()
        for step in range(first, last):
            rm = (1 - momentum) * rm + momentum * H.bn_batch(step, rank).mean(0)
        return rm

    zero = torch.zeros(16)
    rank0 = ema(0, zero, 0, steps)
    torch.testing.assert_close(got[0], rank0, rtol=0, atol=1e-6)
    # with broadcasting, rank 1 starts its last forward from rank 0's statistics; without, from its own
    start = ema(0, zero, 0, steps - 1) if broadcast else ema(1, zero, 0, steps - 1)
    torch.testing.assert_close(got[1], ema(1, start, steps - 1, steps), rtol=0, atol=1e-6)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_parameter_unused_everywhere_with_adamw(ranks, engine):
    """Documented choice: an exact zero gradient, so AdamW's decoupled weight decay alone moves it."""
    ref = H.unused_adamw_reference()
    lr, wd, steps = 0.01, 0.1, 3
    for got in results(ranks, "unused", engine):
        assert torch.count_nonzero(got["unused_grad"]) == 0
        for k, want in ref.items():
            if k.startswith("unused."):  # torch leaves it untouched; a zero grad decays it (Adam's update is 0)
                want = (1 - lr * wd) ** steps * H.make_model("unused", seed=0).state_dict()[k]
            torch.testing.assert_close(got["state"][k], want, rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("engine", HOOK_ENGINES)
def test_end_of_backward_callback_keeps_no_model_alive(ranks, engine):
    # autograd can hold a backward's callback after backward() returned (a model was seen alive after del and
    # gc.collect() on lesson 05's simulated GPU ranks): what it holds must not keep the wrapper or its model
    for r in results(ranks, "callback", engine):
        assert r == {"queued": 2, "model_freed": True}, r


def test_bucket_assignment_keeps_one_open_bucket_per_dtype():
    model = MixedDtypeModel()  # 8 weights: bf16, fp32, bf16, ... (512 B and 1 KiB)
    params = list(reversed(list(model.parameters())))
    assert [len(b) for b in assign_buckets(params, 25 * 2**20)] == [4, 4]
    # a 1100 B cap closes each bucket once it reaches the cap (fp32 256 + 1024 B, bf16 3 x 512 B, fp32 2 x 1024 B);
    # they are ordered by the arrival of their last gradient
    name = {p: i for i, p in enumerate(model.parameters())}  # 7 = head (fp32) ... 0 = first layer (bf16)
    got = [[name[p] for p in b] for b in assign_buckets(params, 1100)]
    assert got == [[7, 5], [6, 4, 2], [3, 1], [0]]


@pytest.mark.parametrize("engine", DDP_ENGINES)
def test_interleaved_bf16_fp32_cost_one_collective_per_dtype(ranks, engine):
    want_calls = {"naive": 8, "overlap": 8, "flat": 2, "bucketed": 2}[engine]
    both = results(ranks, "bf16", engine)
    for got in both:
        assert got["calls"] == want_calls
        for g, *local in zip(got["grads"], *[r["local"] for r in both]):
            # bf16 grads are divided and summed in bf16: a few bf16 ulps from the fp32 mean
            torch.testing.assert_close(g, torch.stack(local).mean(0), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("engine", HOOK_ENGINES)
def test_reentrant_checkpoint_inside_the_model_still_synchronizes(ranks, engine):
    """The end-of-backward sync is queued on the outer backward, not on the checkpoint's nested one."""
    for got in results(ranks, "reentrant", engine):
        for a, b in zip(got[True], got[False]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_freezing_after_wrapping_never_moves_the_parameter(ranks, engine):
    """A zero gradient on a parameter frozen after wrapping would let AdamW move it.

    The simple class re-reads requires_grad at every sync (it follows the change); the engines plan their
    all-reduces at construction, so they refuse the next forward, as torch DDP fails, and a new wrapper works.
    """
    for got in results(ranks, "freeze", engine):
        assert not got["moved"], "AdamW moved a parameter frozen after wrapping"
        if engine == "simple":
            assert got["error"] is None
        else:
            assert got["error"] is not None and "requires_grad changed after wrapping" in got["error"]
            assert "0.weight" in got["error"] and "wrap the module again" in got["error"]
        assert got["error_after_rewrap"] is None
        assert not got["moved_after_rewrap"] and got["grad_after_rewrap"] is None


@pytest.mark.parametrize("engine", list(ENGINES))
def test_non_contiguous_gradients_are_averaged(ranks, engine):
    """A transposed parameter's gradient is non-contiguous; gloo/NCCL reduce contiguous tensors."""
    ref = H.noncontiguous_reference()
    assert ref["contiguous"] == [False, False], "the case must really produce non-contiguous gradients"
    both = results(ranks, "noncontig", engine)
    for got in both:
        assert got["contiguous"] and all(got["contiguous"]), \
            f"a non-contiguous tensor entered dist.all_reduce (NCCL rejects it): {got['contiguous']}"
        for k, want in ref["state"].items():
            torch.testing.assert_close(got["state"][k], want, rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    for k in both[0]["state"]:
        assert torch.equal(both[0]["state"][k], both[1]["state"][k]), k
