"""FSDP (ZeRO-3): equals single-process training at 2 and 3 ranks in fp32 and bf16; gathers, frees, prefetches."""

from __future__ import annotations

import pytest
import torch

import fsdp_cases as C
from ddp_lib.fsdp import FSDP
from ddp_lib.launch import spawn
from ddp_lib.kit.models import ToyModel

CASES = [(2, None), (3, None), (2, torch.bfloat16), (3, torch.bfloat16)]


def case_id(case) -> str:
    return f"ws{case[0]}-{'fp32' if case[1] is None else str(case[1]).removeprefix('torch.')}"


@pytest.fixture(scope="module", params=CASES, ids=case_id)
def lm(request):
    ws, dtype = request.param
    return ws, dtype, spawn(C.train_lm, world_size=ws, args=(dtype,), timeout_s=300), C.train_reference(ws, dtype)


def test_every_step_equals_single_process(lm):
    """fp32: 1e-5 against one process on the full batch; bf16: against the same recipe there (bf16 rounding apart)."""
    ws, dtype, ranks, (ref_params, ref_losses) = lm
    # bf16: a half batch rounds its gradient differently from the full one (measured up to 2.5e-3 at 3 ranks)
    tol = 1e-5 if dtype is None else 1e-2
    for step in range(C.STEPS):
        loss = sum(r["losses"][step] for r in ranks) / ws  # mean of equal local batches = the full-batch mean
        assert loss == pytest.approx(ref_losses[step], rel=tol)
        for rank in ranks:
            full = rank["params"][step]
            assert list(full) == list(ref_params[step])  # named as in the module
            for name, want in ref_params[step].items():
                assert full[name].dtype == torch.float32 and full[name].shape == want.shape
                torch.testing.assert_close(full[name], want, rtol=0, atol=tol, msg=f"step {step}, {name}")


def test_first_step_is_the_recipe_exactly(lm):
    """Same local batch, same weights: the forward is the recipe's, and the gradient its rank average in fp32."""
    ws, dtype, ranks, _ = lm
    for rank in ranks:
        assert rank["logits_dtype"] == (dtype or torch.float32)
        assert rank["grad_dtypes"] == {torch.float32} and rank["grad_shapes_ok"]
        assert rank["loss_vs_recipe"] <= 1e-6
        assert rank["grad_rel_vs_recipe"] <= 1e-5  # a bf16 reduction would be off by ~4e-3


def test_parameters_are_shards(lm):
    ws, _, ranks, (ref_params, _) = lm
    full = sum(p.numel() for p in ref_params[0].values())
    assert all(r["shard_numel"] < 0.6 * full for r in ranks)  # biases and norms (replicated) are small


@pytest.fixture(scope="module", params=[1, 2], ids=["one-backward", "two-backwards"])
def mlp(request):
    return request.param, spawn(C.mlp_steps, world_size=2, args=(request.param,), timeout_s=120), C.mlp_reference()


def test_mlp_equals_single_process(mlp):
    _, ranks, ref = mlp
    for rank in ranks:
        for name, want in ref.items():
            torch.testing.assert_close(rank["params"][name], want, rtol=0, atol=1e-5)


def test_collectives_per_step(mlp):
    """Forward gathers each of the 4 weights once; backward again all but the first layer's (autograd never saves
    it: its input needs no gradient); one reduce-scatter per weight per backward; one flat all-reduce of the biases
    per backward (each backward synchronizes when it ends, as the DDP engines do)."""
    accumulate, ranks, _ = mlp
    for rank in ranks:
        for step in rank["steps"]:
            kinds = [name for name, _, _ in step["log"]]
            assert kinds.count("all_gather") == accumulate * (4 + 3)
            assert kinds.count("reduce_scatter") == accumulate * 4
            assert kinds.count("all_reduce") == accumulate
            for kind in ("all_gather", "reduce_scatter", "all_reduce"):  # the engine's own count is right: the
                # last synchronized backward's (its forward included); each backward here moves the same bytes
                assert step["comm_bytes"][kind] * accumulate == sum(b for name, b, _ in step["log"] if name == kind)
            assert step["comm_calls"] == len(step["log"]) // accumulate


def test_gathered_just_in_time_and_freed(mlp):
    _, ranks, _ = mlp
    for rank in ranks:
        assert all(rank["prefetched"])  # each layer's forward starts with the next layer's gather under way
        for step in rank["steps"]:
            assert all(len(live) <= 2 for _, _, live in step["log"])  # never more than this layer and the next
            assert step["live_after_forward"] == [0] * len(step["live_after_forward"])
            assert step["live_after_finish"] == 0
            backward = [live for name, _, live in step["log"] if name == "reduce_scatter"]
            units = rank["units"]
            for live in backward[:2]:  # while a layer's gradient is reduced, the layer before it is being gathered
                # (not before layers.1: layers.0 is not needed in backward)
                assert units[units.index(live[-1]) - 1] in live


@pytest.fixture(scope="module")
def odd():
    return spawn(C.odd_models, world_size=2, timeout_s=120)


@pytest.mark.parametrize("name", ["unused", "frozen"])
def test_unused_and_frozen_layers(odd, name):
    """A layer unused in a step (or never) neither hangs nor corrupts; a frozen sharded layer stays put."""
    ref = C.odd_reference(name)
    for rank in odd:
        for pname, want in ref.items():
            torch.testing.assert_close(rank[name][pname], want, rtol=0, atol=1e-5, msg=pname)
    assert all(r["unused_grad_zero"] for r in odd)


def test_a_failing_forward_leaves_the_model_usable(odd):
    for rank in odd:
        assert rank["raised"] and rank["restored"] and rank["after_error_grads"]


def test_clear_errors_for_modules_it_cannot_shard():
    messages = spawn(C.construction_errors, world_size=2, timeout_s=120)[0]
    assert "has no floating-point `weight` Parameter" in messages["no weight"]
    assert "also holds directly" in messages["shared with a replicated module"]
    assert "sparse=True" in messages["sparse embedding"]


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="not initialised"):
        FSDP(ToyModel())
