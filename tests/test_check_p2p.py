"""Point-to-point calls under the checker (Property(..., p2p=True), for a learner's ring): a right ring passes;
both ranks receiving first, or sizes that differ, fail within the limit, and the next check passes."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from ddp_lib.launch import spawn

from _mutations import warm_up

LIMIT_S = 5.0  # the checks' timeout here (60 s by default); ranks are warmed up first


def ring_good(t):
    r, ws = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    w = dist.isend(t.clone(), (r + 1) % ws)
    dist.recv(buf, (r - 1) % ws)
    w.wait()
    return t + buf


def ring_recv_first(t):  # deadlocks without the checker: each rank waits for the other's send
    r, ws = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    dist.recv(buf, (r - 1) % ws)
    dist.send(t, (r + 1) % ws)
    return t + buf


def ring_sizes(t):  # rank 1 receives one element more than rank 0 sends
    r, ws = dist.get_rank(), dist.get_world_size()
    buf = torch.empty(t.numel() + r)
    w = dist.isend(t.clone(), (r + 1) % ws)
    dist.recv(buf, (r - 1) % ws)
    w.wait()
    return t + buf[: t.numel()]


def ring_irecv_sizes(t):
    r, ws = dist.get_rank(), dist.get_world_size()
    buf = torch.empty(t.numel() + r)
    rw = dist.irecv(buf, (r - 1) % ws)
    w = dist.isend(t.clone(), (r + 1) % ws)
    rw.wait()
    w.wait()
    return t + buf[: t.numel()]


CASES = [ring_good, ring_recv_first, ring_good, ring_sizes, ring_good, ring_irecv_sizes, ring_good]


def run_cases() -> list:
    from ddp_lib.check import Property, max_diff, run_check

    out = []
    for fn in CASES:
        def prop(fn=fn):
            t = torch.arange(4.0) + dist.get_rank()
            return max_diff({"sum": fn(t)}, {"sum": sum(torch.arange(4.0) + r for r in range(dist.get_world_size()))})

        t0 = time.monotonic()
        res = run_check("ring", [Property("ring sum", prop, "send to the next rank", p2p=True)], timeout_s=LIMIT_S)
        out.append((fn.__name__, res.passed, time.monotonic() - t0, res.table()))
    x = torch.ones(1)
    dist.all_reduce(x)
    out.append(x.item())
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_warm_then_run, 2, backend="gloo", timeout_s=120)


def test_right_ring_passes_every_time(results):
    for name, passed, _, table in results[0][:-1]:
        assert passed == (name == "ring_good"), table


@pytest.mark.parametrize("i, words", [(1, "no matching call"), (3, "float32[5]"), (5, "float32[5]")])
def test_mistakes_end_within_the_limit_and_say_why(results, i, words):
    name, passed, seconds, table = results[0][i]
    assert not passed and words in table and seconds < 3 * LIMIT_S, table


def test_group_still_usable(results):
    assert results[0][-1] == results[1][-1] == 2.0


def _warm_then_run():
    warm_up()
    return run_cases()
