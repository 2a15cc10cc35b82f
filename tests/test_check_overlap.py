"""Lesson 05's checkers (ddp_lib.check.overlap) on 2 gloo ranks: the right answers pass, stubs read "not written
yet", planted mistakes fail the property named for them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddp_lib.check.overlap import check_bucket_engine, check_bucket_plan, check_overlap_hook
from ddp_lib.launch import spawn

from _answers import HandOverlap


class HandStub(HandOverlap):
    def _ready(self, p):
        raise NotImplementedError("your turn")


class HandNoDivision(HandOverlap):
    def _ready(self, p):
        self.handles.append(dist.all_reduce(p.grad, async_op=True))


class HandLaunchInFinish(HandOverlap):  # correct gradients, but nothing overlaps backward
    def __init__(self, model):
        self.params = list(model.parameters())

    def finish(self) -> int:
        for p in self.params:
            p.grad.div_(dist.get_world_size())
            dist.all_reduce(p.grad)
        return len(self.params)


class HandForgetsCount(HandOverlap):
    def finish(self):
        for h in self.handles:
            h.wait()
        self.handles = []


def plan_good(params, cap_bytes, first_cap_bytes):
    buckets, size = [[]], 0
    for p in reversed(params):
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
        if size >= (first_cap_bytes if len(buckets) == 1 else cap_bytes):
            buckets.append([])
            size = 0
    return [b for b in buckets if b]


def plan_stub(params, cap_bytes, first_cap_bytes):
    raise NotImplementedError("your turn")


def plan_forward_order(params, cap_bytes, first_cap_bytes):
    return plan_good(list(reversed(params)), cap_bytes, first_cap_bytes)


def plan_ignores_first_cap(params, cap_bytes, first_cap_bytes):
    return plan_good(params, cap_bytes, cap_bytes)


CASES = {"hook good": (check_overlap_hook, HandOverlap), "hook stub": (check_overlap_hook, HandStub),
         "hook no division": (check_overlap_hook, HandNoDivision),
         "hook launch in finish": (check_overlap_hook, HandLaunchInFinish),
         "hook forgets count": (check_overlap_hook, HandForgetsCount),
         "plan good": (check_bucket_plan, plan_good), "plan stub": (check_bucket_plan, plan_stub),
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


class HandBuckets:  # lesson 05's solution (uses the plan above)
    def __init__(self, model, cap_mb=2.0):
        params = list(model.parameters())
        self.buckets = plan_good(params, int(cap_mb * 2**20), int(min(1.0, cap_mb) * 2**20))
        self.where = {p: i for i, b in enumerate(self.buckets) for p in b}
        self.handles, self.flat = [], []
        self.reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def reset(self):
        self.pending, self.next = [len(b) for b in self.buckets], 0

    def _ready(self, p):
        self.pending[self.where[p]] -= 1
        while self.next < len(self.buckets) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def _launch(self, i):
        flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[i]]).div_(dist.get_world_size())
        self.flat.append((i, flat))
        self.handles.append(dist.all_reduce(flat, async_op=True))

    def finish(self) -> int:
        for h in self.handles:
            h.wait()
        for i, flat in self.flat:
            offset = 0
            for p in self.buckets[i]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        n = len(self.handles)
        self.handles, self.flat = [], []
        self.reset()
        return n


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


class BucketsLaunchAtEnd(HandBuckets):  # right numbers, no overlap
    def _ready(self, p):
        self.pending[self.where[p]] -= 1

    def finish(self) -> int:
        for i in range(len(self.buckets)):
            self._launch(i)
        return super().finish()


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
