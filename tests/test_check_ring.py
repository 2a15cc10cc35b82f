"""check_ring_allreduce at 2 and 3 gloo ranks: the package's ring and a batch_isend_irecv ring pass, a stub reads
"not written yet", planted mistakes fail the property named for them, and a ring where every rank calls a blocking
send first (a real deadlock under gloo) is reported within the limit, after which the next check passes."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from ddp_lib.comm import ring_allreduce
from ddp_lib.launch import spawn

LIMIT_S = 3.0  # the checks' timeout in these tests (60 s, p2p waits 20 s, by default)


# ------------------------------------------------------------------ learner rings, right and wrong
def ring_batched(x):
    """A right answer in another style: batch_isend_irecv."""
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = x.view(-1).tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        ops = [dist.P2POp(dist.isend, chunks[(r - s) % n], (r + 1) % n),
               dist.P2POp(dist.irecv, incoming, (r - 1) % n)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        chunks[(r - s - 1) % n].add_(incoming)
    for s in range(n - 1):
        ops = [dist.P2POp(dist.isend, chunks[(r + 1 - s) % n], (r + 1) % n),
               dist.P2POp(dist.irecv, chunks[(r - s) % n], (r - 1) % n)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return x


def ring_stub(x):
    raise NotImplementedError("your turn")


def ring_wrong_chunk(x):  # reduce-scatter adds into the chunk it just sent
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = x.view(-1).tensor_split(n)
    for s in range(n - 1):
        req = dist.isend(chunks[(r - s) % n], (r + 1) % n)
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        dist.recv(incoming, (r - 1) % n)
        req.wait()
        chunks[(r - s) % n].add_(incoming[: chunks[(r - s) % n].numel()])
    for s in range(n - 1):
        req = dist.isend(chunks[(r + 1 - s) % n], (r + 1) % n)
        dist.recv(chunks[(r - s) % n], (r - 1) % n)
        req.wait()
    return x


def ring_no_reduce(x):  # only the all-gather phase
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = x.view(-1).tensor_split(n)
    for s in range(n - 1):
        req = dist.isend(chunks[(r + 1 - s) % n], (r + 1) % n)
        dist.recv(chunks[(r - s) % n], (r - 1) % n)
        req.wait()
    return x


def ring_send_first(x):  # every rank's blocking send waits for a receive that never comes
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = x.view(-1).tensor_split(n)
    for s in range(n - 1):
        dist.send(chunks[(r - s) % n].contiguous(), (r + 1) % n)
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        dist.recv(incoming, (r - 1) % n)
        chunks[(r - s - 1) % n].add_(incoming)
    return x


def ring_collective(x):  # right sum, but not built from point-to-point calls
    dist.all_reduce(x)
    return x


def ring_whole_buffer(x):  # pass the whole buffer around the ring: right sum, (n-1) x S bytes sent
    n, r = dist.get_world_size(), dist.get_rank()
    acc, cur = x.clone(), x.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(cur)
        for req in dist.batch_isend_irecv([dist.P2POp(dist.isend, cur, (r + 1) % n),
                                           dist.P2POp(dist.irecv, incoming, (r - 1) % n)]):
            req.wait()
        acc += incoming
        cur = incoming
    x.copy_(acc)
    return x


def ring_out_of_place(x):
    return ring_allreduce(x.clone())


CASES = {"package": ring_allreduce, "batched": ring_batched, "stub": ring_stub, "wrong chunk": ring_wrong_chunk,
         "no reduce phase": ring_no_reduce, "send first": ring_send_first, "collective": ring_collective,
         "whole buffer": ring_whole_buffer, "out of place": ring_out_of_place}


def run_cases(names: list[str]) -> dict:
    """Rank side: each case's verdict, its time, and a plain all_reduce afterwards (the group still works)."""
    from ddp_lib.check.ring import check_ring_allreduce

    out = {}
    for name in names:
        t0 = time.monotonic()
        res = check_ring_allreduce(CASES[name], timeout_s=LIMIT_S, quiet=True)
        out[name] = dict(passed=res.passed, failed=res.failed, status={r.name: r.status for r in res.rows},
                         detail={r.name: r.detail for r in res.rows}, seconds=time.monotonic() - t0)
    t = torch.ones(3)
    dist.all_reduce(t)
    out["group works"] = t.tolist() == [float(dist.get_world_size())] * 3
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def results(request) -> tuple[int, list[dict]]:
    names = list(CASES) + ["package"]  # the package's ring again, after every failure: the ranks stay usable
    return request.param, spawn(run_cases, request.param, args=(names,), backend="gloo", timeout_s=240, threads=1)


def test_identical_on_every_rank_and_group_intact(results):
    _, per_rank = results
    for name in CASES:
        assert len({(tuple(r[name]["failed"]), r[name]["passed"]) for r in per_rank}) == 1, name
    assert all(r["group works"] for r in per_rank)


@pytest.mark.parametrize("name", ["package", "batched"])
def test_right_rings_pass(results, name):
    assert results[1][0][name]["passed"], results[1][0][name]


def test_stub_reads_not_written_yet(results):
    status = list(results[1][0]["stub"]["status"].values())
    # the properties that need the sum wait for it ("not checked"): no property fails
    assert status[0] == "not written yet" and set(status) <= {"not written yet", "not checked"}, status


@pytest.mark.parametrize("name, prop", [
    ("wrong chunk", "sum on every rank"), ("no reduce phase", "sum on every rank"),
    ("send first", "sum on every rank"), ("collective", "point-to-point only"),
    ("out of place", "in place")])
def test_planted_mistake_fails_its_property(results, name, prop):
    res = results[1][0][name]
    assert prop in res["failed"], res


def test_whole_buffer_fails_the_byte_count_beyond_two_ranks(results):
    ws, per_rank = results
    res = per_rank[0]["whole buffer"]
    assert res["status"]["sum on every rank"] == "PASS"
    if ws == 2:  # (n-1) x S = 2(n-1)/n x S at n = 2: the byte count cannot tell them apart
        assert res["passed"], res
    else:
        assert "sends 2(n-1)/n of the buffer" in res["failed"], res


def test_deadlock_is_reported_within_the_limit_not_hung(results):
    res = results[1][0]["send first"]
    detail = res["detail"]["sum on every rank"]
    # the p2p deadlock detector ("would hang"/"stopped") or, where the machine is slow, the check's deadline
    assert "would hang" in detail or "stopped" in detail or "did not return within" in detail, detail
    assert res["seconds"] < 3 * LIMIT_S + 10, res["seconds"]
