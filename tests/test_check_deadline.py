"""Every check ends within its time on a learner's worst answer, and leaves the ranks usable.

Unit tests of `ddp_lib.check._deadline` (one process), then every checker of `ddp_lib.check` that takes the
learner's code, on 2 gloo ranks in ONE spawned group, given answers that never return: an endless loop on one
rank while the other calls a collective alone, and a store wait with no deadline on every rank. Each must end
with a failed property within the check's timeout (plus the verdict exchange), then a collective must still work.
check_hsdp starts 4 ranks of its own, which a spawned (daemonic) rank cannot: it runs from pytest's process.
The checks get a short timeout here (`timeout_s`; the 60 s default is asserted apart): the bound scales with it.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch
import torch.distributed as dist

from ddp_lib.check import _runner
from ddp_lib.check._deadline import TimedOut, shielded, time_limit
from ddp_lib.launch import spawn

LIMIT_S = 1.5  # each check's timeout here (60 s by default): the bound scales with it (3 s took 42 x 2.6 s)
# interrupting the code and exchanging verdicts (2.8 s over the limit once on the 2-core VM loaded by other jobs);
# far below the default limit (60 s) that an ignored timeout_s would take, and the store's 10 min
SLACK_S = 15.0
HSDP_LIMIT_S = 5.0  # check_hsdp's ranks check for 0.8 of it; the rest is for starting them (12 s of the default 60)
HSDP_START_S = 6.0  # starting and ending 4 fresh ranks on a loaded 2-core machine (about 2.5 s when quiet), or
# twice what it takes at the time of the test, whichever is longer (12.3 s against a 12 s bound once, load 8+)
DEADLINE = ("did not return within", "did not reach it within", "no answer within")  # how a deadline's FAIL reads


# ---------------------------------------------------------------------------------------- the deadline alone
def test_an_endless_loop_is_interrupted_and_nothing_stays_pending():
    t0 = time.monotonic()
    with pytest.raises(TimedOut, match="the loop did not return within 0.3 s"):
        with time_limit(0.3, "the loop"):
            while True:
                pass
    assert time.monotonic() - t0 < 2.0
    time.sleep(1.5)  # past the re-fire interval: no interrupt arrives after the limit closed
    assert threading.active_count() >= 1


def test_a_learner_catching_exception_is_interrupted_all_the_same():
    with pytest.raises(TimedOut):
        with time_limit(0.2):
            while True:
                try:
                    time.sleep(0.01)
                except Exception:  # noqa: BLE001 - what a learner's broad except would do
                    pass


def _store_timeout_after(seconds: float):
    def run():
        time.sleep(seconds)
        raise dist.DistStoreError("wait timeout after 1199ms, keys: /never-set")
    return run


def test_the_checks_store_timeout_reads_as_the_deadline_and_a_learners_own_timeout_as_itself():
    """run_check sets the store's timeout to the property's budget: on a loaded machine it can fire before the
    deadline's interrupt, and must then read as the deadline; a learner's short timeout keeps its own error."""
    from ddp_lib.check._runner import Property, _outcome

    late = _outcome(Property("p", _store_timeout_after(0.95), "hint"), budget_s=1.0)
    assert late["status"] == "FAIL" and late["stuck"] and "did not return within 1 s" in late["detail"], late
    early = _outcome(Property("p", _store_timeout_after(0.0), "hint"), budget_s=1.0)
    assert early == {"status": "FAIL", "detail": "DistStoreError: wait timeout after 1199ms, keys: /never-set"}


def test_code_that_returns_in_time_is_untouched():
    with time_limit(5.0):
        x = sum(range(1000))
    assert x == 499500
    time.sleep(0.1)


def test_a_limit_that_passes_while_it_closes_raises_nothing_then_or_later(monkeypatch):
    """The body returned in time, but the limit passed while time_limit was closing (its thread descheduled there, as
    on a loaded machine: here waking the watchdog takes 0.6 s, past the 0.3 s limit). The body's outcome stands and no
    interrupt arrives, then or a second later (a CI run: one landed inside Event.set(), escaped the check, and the
    still-open limit went on raising every second in the code that ran next)."""
    from ddp_lib.check import _deadline

    class SlowToSet(threading.Event):
        def set(self):
            time.sleep(0.6)
            n = 0
            for _ in range(1000):  # Python bytecode, where a pending interrupt is delivered
                n += 1
            super().set()

    monkeypatch.setattr(_deadline.threading, "Event", SlowToSet)
    with time_limit(0.3):
        x = 1
    monkeypatch.undo()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.5:  # past the re-fire interval
        x += 1
    assert x > 1


def test_no_interrupt_inside_a_shielded_call_and_one_at_once_after():
    t0 = time.monotonic()
    with pytest.raises(TimedOut):
        with time_limit(0.1):
            with shielded():  # a collective between agreement and return: never cut
                time.sleep(0.5)
                inside = time.monotonic() - t0
            while True:
                pass
    assert inside >= 0.5


# ------------------------------------------------------------------------------- the learner's worst answers
def _worst(mode: str) -> None:
    if mode == "endless loop on rank 1, rank 0 all-reduces alone":
        if dist.get_rank() == 1:
            n = 0
            while True:
                n += 1
        dist.all_reduce(torch.zeros(1))
        while True:
            pass
    store = dist.distributed_c10d._get_default_store()  # its timeout is the process group's (30 min by default)
    store.get(f"never-set/{uuid.uuid4()}")


class Worst:
    """Whatever a checker calls (a function, a class, an autograd Function's apply) never returns."""

    mode = ""

    def __init__(self, *args, **kwargs):
        _worst(self.mode)

    def __call__(self, *args, **kwargs):
        _worst(self.mode)

    @classmethod
    def apply(cls, *args, **kwargs):
        _worst(cls.mode)


def worst_loop(*args, **kwargs):  # a plain top-level function, for check_hsdp, which ships it to 4 fresh ranks
    _worst("endless loop on rank 1, rank 0 all-reduces alone")


def worst_store(*args, **kwargs):
    _worst("store wait with no deadline")


MODES = ["endless loop on rank 1, rank 0 all-reduces alone", "store wait with no deadline"]
FUNCTIONS = dict(zip(MODES, (worst_loop, worst_store)))
CHECKERS = ["check_get", "check_ring_allreduce", "check_allreduce_timing", "check_sync", "check_seed_verification",
            "check_accumulation", "check_engine", "check_overlap_hook", "check_bucket_plan", "check_bucket_engine",
            "check_exposed_comm", "check_zero1", "check_gather_scatter_fn", "check_saved_tensor_hooks",
            "check_fsdp", "check_hsdp", "check_collective_guard", "check_shadow_step", "check_compression_hook",
            "check_resume", "check_meta_init"]
RANK_CHECKERS = [c for c in CHECKERS if c != "check_hsdp"]  # run on the spawned ranks (see the docstring)


def run_worst() -> dict:
    import ddp_lib.check as check

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # one-time imports before any check
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    out = {"store timeout": str(store.timeout)}
    for name in RANK_CHECKERS:
        for mode in MODES:
            answer = type("Worst", (Worst,), {"mode": mode})
            t0 = time.monotonic()
            answers = (answer, answer) if name == "check_resume" else (answer,)  # its save and its load
            res = getattr(check, name)(*answers, timeout_s=LIMIT_S)
            seconds = time.monotonic() - t0
            t = torch.ones(1)
            dist.all_reduce(t)  # the ranks are usable: a collective right after works
            out[name, mode] = {"seconds": seconds, "failed": res.failed, "table": res.table(), "after": t.item(),
                               "statuses": [r.status for r in res.rows]}
    out["store timeout after"] = str(store.timeout)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(run_worst, 2, backend="gloo", timeout_s=600)


def test_every_checker_of_learner_code_is_covered():
    import ddp_lib.check as check

    assert sorted(CHECKERS) == sorted(n for n in check.__all__ if n.startswith("check_"))


CASES = [(c, m) for c in RANK_CHECKERS for m in MODES]


@pytest.mark.slow
@pytest.mark.parametrize("name, mode", CASES, ids=[f"{c}-{m.split()[0]}" for c, m in CASES])
def test_worst_answer_fails_within_the_limit_and_the_ranks_stay_usable(results, name, mode):
    for r in results:
        case = r[name, mode]
        assert case["seconds"] < LIMIT_S + SLACK_S, case["table"]
        assert "FAIL" in case["statuses"], case["table"]
        assert any(text in case["table"] for text in DEADLINE), case["table"]  # failed by the deadline, not otherwise
        assert case["after"] == 2.0
    assert results[0][name, mode]["failed"] == results[1][name, mode]["failed"]


def _nothing() -> None:
    pass


@pytest.fixture(scope="module")
def start_s(results) -> float:
    """The allowance for starting and ending 4 fresh gloo ranks: twice what it costs on this machine now (after
    `results` warmed the spawner), at least HSDP_START_S."""
    t0 = time.monotonic()
    spawn(_nothing, world_size=4, backend="gloo", timeout_s=120)
    return max(HSDP_START_S, 2 * (time.monotonic() - t0))


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES, ids=[m.split()[0] for m in MODES])
def test_check_hsdp_on_its_own_ranks_fails_a_worst_answer_within_the_limit(results, start_s, mode):
    from ddp_lib.check import check_hsdp

    # `results` started the fork server (it imports torch: about 10 s on a loaded machine, once per pytest process,
    # which a learner's kernel has paid long before a check runs), so the time below is the check's own

    t0 = time.monotonic()
    res = check_hsdp(FUNCTIONS[mode], timeout_s=HSDP_LIMIT_S)
    seconds = time.monotonic() - t0
    assert seconds < 0.8 * HSDP_LIMIT_S + SLACK_S + start_s, (start_s, res.table())
    assert res.rows[0].status == "FAIL" and any(text in res.rows[0].detail for text in DEADLINE), res.table()


@pytest.mark.slow
def test_the_default_store_keeps_its_timeout(results):
    for r in results:
        assert r["store timeout"] == r["store timeout after"]


def test_the_default_bound_is_a_minute_and_the_setting_is_read(monkeypatch):
    monkeypatch.delenv("DDP_CHECK_TIMEOUT", raising=False)
    assert _runner._timeout(None) == _runner.DEFAULT_TIMEOUT_S <= 60  # what a learner's check gets
    monkeypatch.setenv("DDP_CHECK_TIMEOUT", "7")
    assert _runner._timeout(None) == 7.0  # the documented setting (run_check's docstring)
    assert _runner._timeout(LIMIT_S) == LIMIT_S  # an explicit timeout_s, as the tests above pass, wins
