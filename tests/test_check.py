"""ddp_lib.check on 2 gloo ranks: the package passes, stubs read "not written yet", planted mistakes fail
the property named for them, a planted hang or size mismatch ends within the limit and the next check passes."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from ddp_lib.launch import spawn

from _answers import accum_no_division, accum_sync_every_micro_batch, verify_local_verdict
from _mutations import warm_up

LIMIT_S = 8.0  # the checks' timeout here (60 s by default); ranks are warmed up first
FIRST = "weights untouched"  # check_sync's first property: where a rank that raises, hangs or is late shows


# ------------------------------------------------------------------ learner functions, right and wrong
def sync_good(model):
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def sync_stub(model):
    raise NotImplementedError("your turn")


def sync_no_division(model):
    for p in model.parameters():
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)


def sync_weights(model):  # reduces the weights instead of the gradients
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()


def sync_skips_none(model):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def sync_raises_on_rank1(model):
    if dist.get_rank() == 1:
        raise KeyError("oops on one rank")
    sync_good(model)


def sync_extra_call_on_rank0(model):  # rank 1 never joins: without the guard, rank 0 would wait forever
    sync_good(model)
    if dist.get_rank() == 0:
        dist.all_reduce(torch.zeros(1))


def sync_slow_rank1(model):  # rank 1 arrives after the limit: rank 0 gives up, and rank 1 must not enter alone
    if dist.get_rank() == 1 and not getattr(sync_slow_rank1, "slept", False):
        sync_slow_rank1.slept = True  # once: the first property
        time.sleep(LIMIT_S + 1.5)
    sync_good(model)


def sync_sizes_differ(model):  # gloo would abort the process (SIGABRT) if this reached it
    dist.all_reduce(torch.zeros(3 + dist.get_rank()))
    sync_good(model)


def verify_good(model):
    from ddp_lib.ddp import SimpleDistributedDataParallelism

    SimpleDistributedDataParallelism(model)


def verify_stub(model):
    raise NotImplementedError


def verify_first_param_only(model):
    p = next(model.parameters()).detach().clone()
    p0 = p.clone()
    dist.broadcast(p0, src=0)
    bad = torch.tensor([float(not torch.equal(p, p0))])
    dist.all_reduce(bad)
    if bad.item():
        raise ValueError("differs")


def verify_by_broadcast(model):  # fixes instead of refusing
    for p in model.parameters():
        dist.broadcast(p.data, src=0)


def accum_good(ddp, micro_batches, loss_fn):
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with (torch.enable_grad() if last else ddp.no_sync()):
            (loss_fn(ddp(x), y) / len(micro_batches)).backward()
    ddp.sync_gradients()


def accum_stub(ddp, micro_batches, loss_fn):
    raise NotImplementedError


CASES = {
    "sync_good": ("check_sync", sync_good), "sync_stub": ("check_sync", sync_stub),
    "sync_no_division": ("check_sync", sync_no_division), "sync_weights": ("check_sync", sync_weights),
    "sync_skips_none": ("check_sync", sync_skips_none), "sync_raises_on_rank1": ("check_sync", sync_raises_on_rank1),
    "hang": ("check_sync", sync_extra_call_on_rank0), "after_hang": ("check_sync", sync_good),
    "slow": ("check_sync", sync_slow_rank1), "after_slow": ("check_sync", sync_good),
    "sizes": ("check_sync", sync_sizes_differ), "after_sizes": ("check_sync", sync_good),
    "verify_good": ("check_seed_verification", verify_good), "verify_stub": ("check_seed_verification", verify_stub),
    "verify_local_verdict": ("check_seed_verification", verify_local_verdict),
    "verify_first_param_only": ("check_seed_verification", verify_first_param_only),
    "verify_by_broadcast": ("check_seed_verification", verify_by_broadcast),
    "accum_good": ("check_accumulation", accum_good), "accum_stub": ("check_accumulation", accum_stub),
    "accum_sync_every_micro_batch": ("check_accumulation", accum_sync_every_micro_batch),
    "accum_no_division": ("check_accumulation", accum_no_division),
}


def run_cases() -> dict:
    """On each rank: every case in order, then one plain all-reduce on the caller's default group."""
    import ddp_lib.check as check

    import ddp_lib.compat as compat

    originals = [dist.all_reduce, dist.broadcast, compat.all_gather_single, compat.reduce_scatter_single,
                 dist.Work.wait]
    out = {}
    for name, (checker, fn) in CASES.items():
        t0 = time.monotonic()
        res = getattr(check, checker)(fn, timeout_s=LIMIT_S)
        out[name] = {"passed": res.passed, "failed": res.failed, "seconds": time.monotonic() - t0,
                     "rows": {r.name: (r.status, r.ranks, r.detail) for r in res.rows}, "table": res.table()}
    ran = []

    def wrong():
        raise check.Mismatch("off by one", 1.0)

    def after():
        ran.append("after")  # must never run: it needs "wrong" to pass first

    props = [check.Property("wrong", wrong, "fix it"), check.Property("after", after, "a hint for after", needs=("wrong",)),
             check.Property("independent", lambda: None)]
    res = check.run_check("needs", props, timeout_s=LIMIT_S)
    out["needs"] = {"rows": {r.name: (r.status, r.detail, r.hint) for r in res.rows}, "ran": ran,
                    "failed": res.failed, "table": res.table()}
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)  # the default group survived every mistake
    out["group_after"] = t.item()
    out["restored"] = originals == [dist.all_reduce, dist.broadcast, compat.all_gather_single,
                                    compat.reduce_scatter_single, dist.Work.wait]
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_warm_then_run, 2, backend="gloo", timeout_s=240)


def test_identical_on_every_rank_and_group_intact(results):
    r0, r1 = results
    for name in CASES:
        assert (r0[name]["passed"], r0[name]["failed"]) == (r1[name]["passed"], r1[name]["failed"]), name
    assert r0["group_after"] == r1["group_after"] == 3.0


@pytest.mark.parametrize("name", ["sync_good", "verify_good", "accum_good", "after_hang", "after_sizes", "after_slow"])
def test_the_package_and_a_right_answer_pass(results, name):
    assert results[0][name]["passed"], results[0][name]["table"]


@pytest.mark.parametrize("name", ["sync_stub", "verify_stub", "accum_stub"])
def test_stub_reads_not_written_yet(results, name):
    res = results[0][name]
    statuses = [s for s, _, _ in res["rows"].values()]
    # a property that needs an unwritten one waits for it ("not checked"): no property fails
    assert statuses[0] == "not written yet" and set(statuses) <= {"not written yet", "not checked"}, res["table"]
    assert "not written yet" in res["table"]


@pytest.mark.parametrize("name, prop", [
    ("sync_no_division", "grads averaged (= one process)"),
    ("sync_weights", "weights untouched"),
    ("sync_skips_none", "grad None on one rank"),
    ("verify_local_verdict", "different seeds refused on every rank"),
    ("verify_first_param_only", "swapped values found"),
    ("verify_by_broadcast", "different seeds refused on every rank"),
    ("accum_sync_every_micro_batch", "one sync per step (no_sync silent)"),
    ("accum_no_division", "equals the big batch"),
])
def test_planted_mistake_fails_its_property(results, name, prop):
    res = results[0][name]
    assert prop in res["failed"], res["table"]
    assert res["rows"][prop][0] == "FAIL"


def test_planted_mistakes_name_the_cause(results):
    r = results[0]
    assert "summed, not divided" in r["sync_no_division"]["rows"]["grads averaged (= one process)"][2]
    assert r["sync_weights"]["rows"]["weights untouched"][0] == "FAIL"
    # the package's right answers on the other properties stay right
    assert "equals the big batch" not in r["accum_sync_every_micro_batch"]["failed"]
    assert "equal replicas accepted" not in r["verify_local_verdict"]["failed"]


def test_exception_on_one_rank_fails_on_that_rank_only(results):
    rows = results[0]["sync_raises_on_rank1"]["rows"]
    status, ranks, detail = rows[FIRST]
    assert (status, ranks) == ("FAIL", [1])
    assert detail.startswith("rank 1: KeyError") and "Traceback" not in detail


def test_planted_hang_ends_within_the_limit(results):
    res = results[0]["hang"]
    status, ranks, detail = res["rows"][FIRST]
    assert status == "FAIL" and 0 in ranks and "all_reduce" in detail, res["table"]
    assert res["seconds"] < 4 * LIMIT_S  # 4 properties, each bounded by the limit (in practice: at once)
    assert "same collectives, in the same order" in res["table"]  # the hint for a desynchronisation
    assert results[0]["after_hang"]["passed"]


def test_a_rank_past_the_limit_fails_and_never_enters_alone(results):
    res = results[0]["slow"]
    status, ranks, detail = res["rows"][FIRST]
    # rank 0 gives up waiting for rank 1's signature; rank 1, interrupted at the check's deadline, never enters
    assert status == "FAIL" and 0 in ranks and "rank 1 did not reach it within" in detail, res["table"]
    assert "rank 1: the code under check did not return within" in detail, res["table"]
    assert res["seconds"] < 3 * LIMIT_S
    assert [r for r, (s, _, _) in res["rows"].items() if s == "FAIL"] == [FIRST]


def test_sizes_that_differ_are_caught_before_gloo_aborts(results):
    res = results[0]["sizes"]
    detail = res["rows"][FIRST][2]
    assert "differs across ranks" in detail and "float32[3]" in detail and "float32[4]" in detail, res["table"]
    assert results[0]["after_sizes"]["passed"]


def test_a_property_whose_need_failed_reads_not_checked_and_never_runs(results):
    for r in results:
        rows = r["needs"]["rows"]
        assert rows["wrong"][0] == "FAIL" and rows["independent"][0] == "PASS"
        assert rows["after"] == ("not checked", "needs wrong first", ""), r["needs"]["table"]
        assert r["needs"]["ran"] == [] and r["needs"]["failed"] == ["wrong", "after"]
    assert "a hint for after" not in results[0]["needs"]["table"]  # one mistake, one diagnosis


def test_the_guard_is_gone_after_a_check(results):
    assert results[0]["restored"] and results[1]["restored"]


def _warm_then_run():
    warm_up()
    return run_cases()
