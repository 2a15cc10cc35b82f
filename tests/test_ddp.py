"""Every DDP engine on 2 gloo ranks against single-process training on the full batch."""

from __future__ import annotations

import pytest
import torch

import ddp_cases as C
from ddp_lib.kit.data import shard_batch
from ddp_lib.ddp import ENGINES, BucketedDDP
from ddp_lib.launch import spawn
from ddp_lib.kit.models import ToyModel

ENGINE_NAMES = list(ENGINES)
# (engine, model, bucket MB, micro-batches per step, wrapped twice) per world size
CASES = {
    2: [(e, m, None, 1, False) for e in ENGINE_NAMES if e != "bucketed" for m in ("frozen", "tied", "mixed")]
    + [("bucketed", m, mb, 1, False) for m in ("frozen", "tied", "mixed") for mb in (1e-9, 1e-3, 25.0)]
    + [(e, "frozen", 25.0 if e == "bucketed" else None, 4, False) for e in ENGINE_NAMES]  # no_sync accumulation
    + [("bucketed", "tied", 1e-3, 2, False)]
    + [(e, m, 1e-3 if e == "bucketed" else None, 1, True) for e in ENGINE_NAMES for m in ("tied",)],  # re-run cell
    3: [(e, "frozen", 25.0 if e == "bucketed" else None, 1, False) for e in ENGINE_NAMES]  # odd world size
    + [("bucketed", "tied", 1e-3, 2, False), ("overlap", "mixed", None, 4, False), ("flat", "mixed", None, 1, False)],
}
ALL = [(ws, case) for ws, cases in CASES.items() for case in cases]

# all-reduces per synchronized step, counted by hand from the models' shapes:
# frozen: head.weight 512 B + head.bias 16 B; tied: embed 3200 B, mid.weight 1024 B, mid.bias 64 B;
# mixed: 4 bias-free weights, fp32 and fp64 alternating (1 KiB, 2 KiB, 1 KiB, then the fp64 head 512 B)
N_TRAINABLE = {"frozen": 2, "tied": 3, "mixed": 4}
BUCKETS = {  # (model, cap MB) -> buckets; a bucket closes once it reaches the cap. 1e-3 MB = 1048 B: tied's
    # bias + mid.weight (1088 B) close one bucket, embed another; mixed: head + the 2 KiB weight (fp64), the two fp32
    ("frozen", 1e-9): 2, ("frozen", 1e-3): 1, ("frozen", 25.0): 1,
    ("tied", 1e-9): 3, ("tied", 1e-3): 2, ("tied", 25.0): 1,
    ("mixed", 1e-9): 4, ("mixed", 1e-3): 2, ("mixed", 25.0): 2,
}


def expected_calls(engine: str, model: str, mb: float | None) -> int:
    if engine == "bucketed":
        return BUCKETS[model, mb]
    if engine == "flat":
        return 2 if model == "mixed" else 1  # one per dtype
    return N_TRAINABLE[model]


def case_id(item) -> str:
    ws, (engine, model, mb, acc, rewrap) = item
    return f"ws{ws}-{engine}{'' if mb is None else f'[{mb:g}MB]'}-{model}-acc{acc}{'-rewrap' if rewrap else ''}"


@pytest.fixture(scope="module")
def matrix():
    runs: dict[int, list] = {}

    def on(ws: int) -> list:
        if ws not in runs:
            runs[ws] = spawn(C.run_matrix, world_size=ws, args=(CASES[ws],), timeout_s=300)
        return runs[ws]
    return on


@pytest.fixture(scope="module")
def references():
    return {m: C.train_reference(m) for m in ("frozen", "tied", "mixed")}


def assert_state_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("item", ALL, ids=case_id)
def test_matches_single_process_training(matrix, references, item):
    ws, case = item
    want_state, want_losses = references[case[1]]
    ranks = matrix(ws)
    for rank_result in ranks:
        got = rank_result[case]
        if isinstance(got, Exception):
            raise got
        assert_state_close(got["state"], want_state)
        assert got["losses"] == pytest.approx(want_losses, abs=1e-5)
    # the ranks end bit-identical: they applied the same averaged gradient
    for other in ranks[1:]:
        for k, v in ranks[0][case]["state"].items():
            assert torch.equal(v, other[case]["state"][k]), k


@pytest.mark.parametrize("item", ALL, ids=case_id)
def test_comm_calls(matrix, item):
    ws, (engine, model_name, bucket_mb, _, _) = item
    got = matrix(ws)[0][item[1]]
    if isinstance(got, Exception):
        raise got
    assert got["calls"] == [expected_calls(engine, model_name, bucket_mb)] * C.STEPS


@pytest.mark.parametrize("engine", [e for e in ENGINE_NAMES if e != "simple"])
def test_wrapping_broadcasts_rank0_state(engine):
    r0, r1 = spawn(C.wrap_state, world_size=2, args=(engine,))
    assert any(not torch.equal(r0["before"][k], r1["before"][k]) for k in r0["before"])  # seeds did differ
    for k in r0["before"]:  # trainable, frozen and buffers: all rank 0's
        assert torch.equal(r1["after"][k], r0["before"][k]), k
        assert torch.equal(r0["after"][k], r0["before"][k]), k
    assert "frozen.weight" in r0["before"] and "scale" in r0["before"]
    assert r0["names"] == ["module." + n for n in r0["module_names"]]
    assert r0["same_objects"]


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_unused_parameters_neither_hang_nor_corrupt(engine):
    ranks = spawn(C.unused_branch, world_size=2, args=(engine,), timeout_s=60)
    ref = C.unused_reference()
    for got in ranks:
        for step, (g, w) in enumerate(zip(got["grads"], ref["grads"])):
            for name, want in w.items():
                if want is None:  # used by no rank: a zero gradient, identical everywhere
                    assert torch.count_nonzero(g[name]) == 0, (step, name)
                else:
                    torch.testing.assert_close(g[name], want, rtol=0, atol=1e-6)
        assert_state_close(got["state"], ref["state"])


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("mb", [0, -1.0, float("nan")])
def test_bucket_size_must_be_positive(mb):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        BucketedDDP(ToyModel(), bucket_size_mb=mb)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_no_process_group_is_a_clear_error(engine):
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialised"):
        ENGINES[engine](ToyModel())


def test_uneven_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_batch(torch.zeros(7, 3), rank=0, world_size=2)
    assert shard_batch(torch.arange(8), rank=1, world_size=2).tolist() == [4, 5, 6, 7]


def test_buckets_reverse_order_and_persistent_buffers():
    for r in spawn(C.bucket_layout, world_size=2):
        assert r["order_ok"], "buckets must hold parameters in reverse registration order"
        assert r["n_buckets"] > 1
        assert r["closes_at_cap"], "a bucket must close as soon as it reaches the cap (only the last may be smaller)"
        assert all(p == r["ptrs"][0] for p in r["ptrs"]), "bucket buffers must persist across steps"
        assert all(r["views"]), "after sync every grad is a view into its bucket buffer"


@pytest.mark.parametrize("engine", ["overlap", "bucketed"])
def test_marked_ready_twice_is_a_clear_error(engine):
    for msg in spawn(C.reentrant_twice, world_size=2, args=(engine,)):
        assert "marked ready twice" in msg and "use_reentrant=False" in msg


@pytest.mark.parametrize("engine", [e for e in ENGINE_NAMES if e != "simple"])
def test_bypassing_the_wrapper_is_a_clear_error(engine):
    """ddp.module(x) skips the wrapper's forward: an error, never silently unsynchronized gradients."""
    for errors in spawn(C.bypass_wrapper, world_size=2, args=(engine,)):
        assert len(errors) == 2, errors
        assert all("call ddp(x), not ddp.module(x)" in e for e in errors)


def test_wait_all_empties_the_in_flight_list_first():
    """`comm.wait_all`, the one landing of the hook engines: every work waited for, in order, and none left behind,
    even when a wait raises (nothing of a step outlives it)."""
    from ddp_lib.comm import wait_all

    waited = []

    class Work:
        def __init__(self, name: str, fails: bool = False):
            self.name, self.fails = name, fails

        def wait(self) -> None:
            waited.append(self.name)
            if self.fails:
                raise RuntimeError("peer gone")

    works = [Work("a"), Work("b")]
    wait_all(works)
    assert waited == ["a", "b"] and works == []
    works = [Work("c", fails=True), Work("d")]
    with pytest.raises(RuntimeError, match="peer gone"):
        wait_all(works)
    assert works == []
