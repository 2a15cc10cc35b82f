"""Lesson 05's checkers (ddp_lib.check.overlap_buckets) on 2 gloo ranks: the right answers pass, stubs read "not written
yet", planted mistakes fail the property named for them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_lib.check.overlap_buckets import check_bucket_engine, check_bucket_plan, check_overlap_hook
from ddp_lib.launch import spawn

from _answers import BucketsLaunchAtEnd, HandBuckets, HandLaunchInFinish, HandOverlap, plan_buckets


class HandStub(HandOverlap):
    def _ready(self, p):
        raise NotImplementedError("your turn")


class HandNoDivision(HandOverlap):
    def _ready(self, p):
        self.handles.append(dist.all_reduce(p.grad, async_op=True))


class HandForgetsCount(HandOverlap):
    def finish(self):
        for h in self.handles:
            h.wait()
        self.handles = []


def plan_stub(params, cap_bytes, first_cap_bytes):
    raise NotImplementedError("your turn")


def plan_forward_order(params, cap_bytes, first_cap_bytes):
    return plan_buckets(list(reversed(params)), cap_bytes, first_cap_bytes)


def plan_ignores_first_cap(params, cap_bytes, first_cap_bytes):
    return plan_buckets(params, cap_bytes, cap_bytes)


CASES = {"hook good": (check_overlap_hook, HandOverlap), "hook stub": (check_overlap_hook, HandStub),
         "hook no division": (check_overlap_hook, HandNoDivision),
         "hook launch in finish": (check_overlap_hook, HandLaunchInFinish),
         "hook forgets count": (check_overlap_hook, HandForgetsCount),
         "plan good": (check_bucket_plan, plan_buckets), "plan stub": (check_bucket_plan, plan_stub),
         "plan forward order": (check_bucket_plan, plan_forward_order),
         "plan ignores first cap": (check_bucket_plan, plan_ignores_first_cap)}


def run_cases() -> dict:
    out = {}
    for name, (checker, fn) in CASES.items():
        res = checker(fn, timeout_s=30)
        out[name] = {"passed": res.passed, "failed": res.failed, "status": {r.name: r.status for r in res.rows}}
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(run_cases, 2, backend="gloo", timeout_s=240)


def test_identical_on_every_rank(results):
    assert results[0] == results[1]


@pytest.mark.parametrize("name", ["hook good", "plan good"])
def test_right_answers_pass(results, name):
    assert results[0][name]["passed"], results[0][name]


@pytest.mark.parametrize("name", ["hook stub", "plan stub"])
def test_stub_reads_not_written_yet(results, name):  # the properties that need a stubbed one wait for it
    assert set(results[0][name]["status"].values()) <= {"not written yet", "not checked"}
    assert list(results[0][name]["status"].values())[0] == "not written yet"


@pytest.mark.parametrize("name, prop", [
    ("hook no division", "equal to one process"),
    ("hook launch in finish", "collectives start during backward"),
    ("hook forgets count", "one all-reduce per gradient, counted, step after step"),
    ("plan forward order", "same plan as torch DDP's rule"),
    ("plan ignores first cap", "small first bucket"),
])
def test_planted_mistake_fails_its_property(results, name, prop):
    r = results[0][name]
    assert not r["passed"] and prop in r["failed"], r


class BucketsStub(HandBuckets):
    def _ready(self, p):
        raise NotImplementedError("your turn")


class BucketsNoReset(HandBuckets):  # the second step launches nothing
    def finish(self) -> int:
        n = len(self.handles)
        for h in self.handles:
            h.wait()
        for i, flat in self.flat:
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.handles, self.flat = [], []
        return n


CASES.update({"buckets good": (check_bucket_engine, HandBuckets), "buckets stub": (check_bucket_engine, BucketsStub),
              "buckets no reset": (check_bucket_engine, BucketsNoReset),
              "buckets launch at end": (check_bucket_engine, BucketsLaunchAtEnd)})


def test_bucket_engine_verdicts(results):
    r = results[0]
    assert r["buckets good"]["passed"], r["buckets good"]
    assert list(r["buckets stub"]["status"].values())[0] == "not written yet"
    assert set(r["buckets stub"]["status"].values()) <= {"not written yet", "not checked"}
    assert "equal to one process, step after step" in r["buckets no reset"]["failed"], r["buckets no reset"]
    launch_at_end = r["buckets launch at end"]
    assert launch_at_end["failed"][0] == "buckets start during backward", launch_at_end
    assert set(launch_at_end["status"].values()) == {"PASS", "FAIL", "not checked"}, launch_at_end
