"""check_engine and check_zero1 on 2 gloo ranks: every package engine and ShardedOptimizer pass, stubs read
"not written yet", and planted mistakes fail the property named for them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_lib.contract import DataParallelWrapper
from ddp_lib.ddp.strategy import SyncStrategy
from ddp_lib.launch import spawn

from _answers import LearnerDDP
from _mutations import warm_up

LIMIT_S = 30.0  # the checks' timeout here (60 s by default); ranks are warmed up first


class NoBroadcast(LearnerDDP):
    broadcast = False


class SkipNone(LearnerDDP):
    skip_none = True


class NoDivision(LearnerDDP):
    divide_before = False


class HooksIgnoreNoSync(LearnerDDP):
    hooks_ignore_no_sync = True


class RefuseLocally(LearnerDDP):
    broadcast, refuse_locally = False, True


class StubDDP:
    def __init__(self, module):
        raise NotImplementedError("your turn")


class BaseStrategyDDP(DataParallelWrapper):
    """The front given the base strategy, whose finish() is not written."""

    def __init__(self, module):
        super().__init__(module, strategy=SyncStrategy)


class FullCopyZero1(torch.optim.Optimizer):
    """Steps correctly, but keeps the whole unsharded optimizer around."""

    def __init__(self, params, optimizer_cls, **kwargs):
        params = list(params)
        super().__init__(params, kwargs)
        self.full = optimizer_cls(params, **kwargs)

    def step(self, closure=None):
        return self.full.step(closure)


class NoBroadcastZero1(torch.optim.Optimizer):
    """Keeps only its shard (every other parameter), steps it, and never shares the result."""

    def __init__(self, params, optimizer_cls, **kwargs):
        params = list(params)
        super().__init__(params, kwargs)
        self.inner = optimizer_cls(params[dist.get_rank()::dist.get_world_size()], **kwargs)

    def step(self, closure=None):
        return self.inner.step(closure)


class StubZero1:
    def __init__(self, params, optimizer_cls, **kwargs):
        raise NotImplementedError


def run_cases() -> dict:
    from ddp_lib.check import check_engine, check_zero1
    from ddp_lib.ddp import ENGINES
    from ddp_lib.zero import ShardedOptimizer

    engines = {name: (cls, {"bucket_size_mb": 1e-3} if name == "bucketed" else {}) for name, cls in ENGINES.items()}
    engines.update({c.__name__: (c, {}) for c in (LearnerDDP, NoBroadcast, SkipNone, NoDivision, HooksIgnoreNoSync,
                                                  RefuseLocally, StubDDP, BaseStrategyDDP)})
    out = {}
    for name, (cls, kw) in engines.items():
        r = check_engine(cls, timeout_s=LIMIT_S, **kw)
        out[name] = {"passed": r.passed, "failed": r.failed, "rows": {x.name: (x.status, x.ranks) for x in r.rows},
                     "table": r.table()}
    for cls in (ShardedOptimizer, FullCopyZero1, NoBroadcastZero1, StubZero1):
        r = check_zero1(cls, timeout_s=LIMIT_S)
        out[cls.__name__] = {"passed": r.passed, "failed": r.failed, "table": r.table(),
                             "rows": {x.name: (x.status, x.ranks) for x in r.rows}}
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_warm_then_run, 2, backend="gloo", timeout_s=240)


@pytest.mark.parametrize("name", ["simple", "naive", "flat", "overlap", "bucketed", "LearnerDDP", "ShardedOptimizer"])
def test_package_classes_pass(results, name):
    assert results[0][name]["passed"], results[0][name]["table"]
    assert results[1][name]["passed"]


def test_refusal_on_every_rank_passes_and_is_said(results):
    assert "refused on every rank: ValueError" in results[0]["simple"]["table"]


@pytest.mark.parametrize("name", ["StubDDP", "StubZero1"])
def test_stub_reads_not_written_yet(results, name):
    statuses = [s for s, _ in results[0][name]["rows"].values()]
    # a property that needs an unwritten one waits for it ("not checked"): no property fails
    assert statuses[0] == "not written yet" and set(statuses) <= {"not written yet", "not checked"}, \
        results[0][name]["table"]


def test_base_strategy_without_finish_is_not_written_yet(results):
    rows = results[0]["BaseStrategyDDP"]["rows"]
    assert rows["replicas start equal"][0] == "PASS"  # the front broadcasts
    assert rows["equal to one process"][0] == "not written yet"


@pytest.mark.parametrize("name, prop", [
    ("NoBroadcast", "replicas start equal"),
    ("RefuseLocally", "replicas start equal"),
    ("SkipNone", "unused parameter"),
    ("NoDivision", "equal to one process"),
    ("HooksIgnoreNoSync", "no_sync silent (= big batch)"),
    ("FullCopyZero1", "state is this rank's shard only"),
    ("NoBroadcastZero1", "equal to the unsharded optimizer"),
])
def test_planted_mistake_fails_its_property(results, name, prop):
    res = results[0][name]
    assert prop in res["failed"] and res["rows"][prop][0] == "FAIL", res["table"]
    assert res["failed"] == results[1][name]["failed"]


def test_local_refusal_names_the_rank_that_went_on(results):
    assert results[0]["RefuseLocally"]["rows"]["replicas start equal"][1] == [0]


def _warm_then_run():
    warm_up()
    return run_cases()
