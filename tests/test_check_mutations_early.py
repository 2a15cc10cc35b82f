"""Mutation suites of the checkers of lessons 00-04, on 2 gloo ranks in ONE spawned group.

For each checker: mistakes the lesson's text warns about fail the property they concern (asserted by name),
with one diagnosis (the properties that depend on it read "not checked"), and right answers written another
way pass. Checkers: check_get (00), check_ring_allreduce (01), check_sync and check_seed_verification (02),
check_accumulation (03), check_sync(returns_calls=True) and check_engine (04), and lesson 01's
check_allreduce_timing.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from ddp_lib.launch import spawn

from _answers import LearnerDDP, accum_no_division, accum_sync_every_micro_batch, verify_local_verdict
from _mutations import run_suites, suite_tests

LIMIT_S = 8.0  # the checks' timeout here (60 s by default)


# ---------------------------------------------------------------------------------------- lesson 00: get()
def get_right_by_index(key, dm=None, mesh_dim=None):  # right, another way: the mesh answers per dimension
    if key == "grank":
        return dist.get_rank()
    if key == "lrank":
        return dist.get_node_local_rank(fallback_rank=0)
    if dm is None:
        return {"ws": dist.get_world_size, "rank": dist.get_rank, "pg": lambda: dist.group.WORLD}[key]()
    if key == "ws":
        return dm.size(0 if mesh_dim is None else dm.mesh_dim_names.index(mesh_dim))
    return dm.get_local_rank(mesh_dim) if key == "rank" else dm.get_group(mesh_dim)


def _get_with(**override):
    from ddp_lib.mesh import get

    def learner(key, dm=None, mesh_dim=None):
        if key in override:
            return override[key](dm, mesh_dim)
        return get(key, dm, mesh_dim)
    return learner


GET = {
    "right: package": ("check_get", lambda: __import__("ddp_lib.mesh", fromlist=["get"]).get),
    "right: per dimension": ("check_get", lambda: get_right_by_index),
    "lrank is the global rank": ("check_get", lambda: _get_with(lrank=lambda dm, d: dist.get_rank())),
    "grank from the mesh": ("check_get", lambda: _get_with(
        grank=lambda dm, d: dist.get_rank() if dm is None else dm[d].get_local_rank() if d else dm.get_local_rank())),
    "ws of the whole mesh": ("check_get", lambda: _get_with(
        ws=lambda dm, d: dist.get_world_size() if dm is None else dm.size())),
    "rank always global": ("check_get", lambda: _get_with(rank=lambda dm, d: dist.get_rank())),
    "pg always the world": ("check_get", lambda: _get_with(pg=lambda dm, d: dist.group.WORLD)),
    "rank is LOCAL_RANK": ("check_get", lambda: _get_with(
        rank=lambda dm, d: int(os.environ["LOCAL_RANK"]) if dm is None else dm[d].get_local_rank() if d
        else dm.get_local_rank())),
    "ws from LOCAL_WORLD_SIZE": ("check_get", lambda: _get_with(
        ws=lambda dm, d: int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if dm is None else dm[d].size() if d
        else dm.size())),
}


# ---------------------------------------------------------------------------------- lesson 01: the ring
def _exchange(send, buf, n, r, order=("send", "recv"), wait="all"):
    ops = {"send": dist.P2POp(dist.isend, send, (r + 1) % n), "recv": dist.P2POp(dist.irecv, buf, (r - 1) % n)}
    reqs = dist.batch_isend_irecv([ops[k] for k in order])
    if wait == "all":
        for req in reversed(reqs):
            req.wait()
    elif wait == "recv only":
        reqs[order.index("recv")].wait()
    elif wait == "futures":
        torch.futures.wait_all([req.get_future() for req in reqs])


def _ring(x, step=_exchange, **kw):
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = x.view(-1).tensor_split(n)
    for s in range(n - 1):
        incoming = torch.empty_like(chunks[(r - s - 1) % n])
        step(chunks[(r - s) % n], incoming, n, r, **kw)
        chunks[(r - s - 1) % n].add_(incoming)
    for s in range(n - 1):
        step(chunks[(r + 1 - s) % n], chunks[(r - s) % n], n, r, **kw)
    return x


def _isend_then_recv(send, buf, n, r):  # right on gloo; on NCCL the two need one group
    req = dist.isend(send, (r + 1) % n)
    dist.recv(buf, (r - 1) % n)
    req.wait()


def _irecv_then_isend(send, buf, n, r):
    reqs = [dist.irecv(buf, (r - 1) % n), dist.isend(send, (r + 1) % n)]
    for req in reqs:
        req.wait()


def ring_recv_first_batched(x):  # right, another way: the receive listed first, waits in reverse
    return _ring(x, order=("recv", "send"))


def ring_no_send_wait(x):
    return _ring(x, wait="recv only")


def ring_overwrites(x):  # reduce-scatter overwrites its chunk instead of adding into it
    n, r = dist.get_world_size(), dist.get_rank()
    chunks = x.view(-1).tensor_split(n)
    for s in range(n - 1):
        _exchange(chunks[(r - s) % n], chunks[(r - s - 1) % n], n, r)
    for s in range(n - 1):
        _exchange(chunks[(r + 1 - s) % n], chunks[(r - s) % n], n, r)
    return x


def ring_out_of_place(x):
    return _ring(x.clone())


def ring_all_reduce(x):
    dist.all_reduce(x)
    return x


RING = {
    "right: package": ("check_ring_allreduce", lambda: __import__("ddp_lib.comm", fromlist=["x"]).ring_allreduce),
    "right: receive listed first": ("check_ring_allreduce", lambda: ring_recv_first_batched),
    "isend then blocking recv": ("check_ring_allreduce", lambda: lambda x: _ring(x, step=_isend_then_recv)),
    "irecv and isend unbatched": ("check_ring_allreduce", lambda: lambda x: _ring(x, step=_irecv_then_isend)),
    "send request never waited": ("check_ring_allreduce", lambda: ring_no_send_wait),
    "overwrites instead of adding": ("check_ring_allreduce", lambda: ring_overwrites),
    "out of place": ("check_ring_allreduce", lambda: ring_out_of_place),
    "dist.all_reduce": ("check_ring_allreduce", lambda: ring_all_reduce),
}


# ------------------------------------------------------------------ lessons 02 and 04: averaging gradients
def _trainable_grads(model):
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return params


def sync_foreach(model):  # right, another way: reduce all, then one _foreach_div_
    grads = [p.grad for p in _trainable_grads(model)]
    for g in grads:
        dist.all_reduce(g)
    torch._foreach_div_(grads, dist.get_world_size())


def sync_flat_buffer(model):  # right, another way: one flat buffer
    grads = [p.grad for p in _trainable_grads(model)]
    flat = torch.cat([g.reshape(-1) for g in grads]) / dist.get_world_size()
    dist.all_reduce(flat)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def sync_no_division(model):
    for p in _trainable_grads(model):
        dist.all_reduce(p.grad)


def sync_divides_twice(model):  # divided before and after
    for p in _trainable_grads(model):
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def sync_weights(model):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()


def sync_skips_none(model):
    for p in model.parameters():
        if p.requires_grad and p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def sync_frozen_too(model):  # gives frozen parameters a (zero) gradient
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def naive_sync(model):  # lesson 04's solution: divide first, count the calls
    calls = 0
    for p in _trainable_grads(model):
        p.grad.div_(dist.get_world_size())
        dist.all_reduce(p.grad)
        calls += 1
    return calls


def flat_sync(model):
    sync_flat_buffer(model)
    return 1


def naive_returns_nothing(model):
    naive_sync(model)


def naive_counts_frozen(model):
    naive_sync(model)
    return len(list(model.parameters()))


def naive_no_division(model):
    calls = 0
    for p in _trainable_grads(model):
        dist.all_reduce(p.grad)
        calls += 1
    return calls


def flat_counts_tensors(model):
    sync_flat_buffer(model)
    return sum(1 for p in model.parameters() if p.requires_grad)


SYNC = {
    "right: package": ("check_sync", lambda: __import__("ddp_lib.ddp.simple", fromlist=["x"]).average_gradients),
    "right: _foreach_div_": ("check_sync", lambda: sync_foreach),
    "right: flat buffer": ("check_sync", lambda: sync_flat_buffer),
    "no division": ("check_sync", lambda: sync_no_division),
    "divides twice": ("check_sync", lambda: sync_divides_twice),
    "reduces the weights": ("check_sync", lambda: sync_weights),
    "skips a None grad": ("check_sync", lambda: sync_skips_none),
    "frozen given a grad": ("check_sync", lambda: sync_frozen_too),
}
COUNTED = {  # lesson 04: check_sync(fn, returns_calls=True)
    "right: naive_sync": ("check_sync_calls", lambda: naive_sync),
    "right: flat_sync": ("check_sync_calls", lambda: flat_sync),
    "right: package": ("check_sync_calls", lambda: __import__("ddp_lib.ddp.simple", fromlist=["x"]).average_gradients),
    "returns nothing": ("check_sync_calls", lambda: naive_returns_nothing),
    "counts frozen params": ("check_sync_calls", lambda: naive_counts_frozen),
    "flat counts tensors": ("check_sync_calls", lambda: flat_counts_tensors),
    "no division": ("check_sync_calls", lambda: naive_no_division),
    "divides twice": ("check_sync_calls", lambda: sync_divides_twice),
}


# ------------------------------------------------------------------------ lesson 02: seed verification
def verify_vector(model):  # right, another way: one flat vector, a flag reduced with MAX
    from torch.nn.utils import parameters_to_vector

    mine = parameters_to_vector(p.detach() for p in model.parameters())
    rank0 = mine.clone()
    dist.broadcast(rank0, src=0)
    flag = torch.tensor([0.0 if torch.equal(mine, rank0) else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise ValueError("replicas differ")


def _verify_each(model, same):
    bad = torch.zeros(1)
    for p in model.parameters():
        p0 = p.detach().clone()
        dist.broadcast(p0, src=0)
        bad += 0.0 if same(p.detach(), p0) else 1.0
    dist.all_reduce(bad)
    if bad.item():
        raise ValueError("replicas differ")


def verify_allclose(model):
    _verify_each(model, torch.allclose)


def verify_sample(model):  # the first values of each parameter only
    _verify_each(model, lambda a, b: torch.equal(a.view(-1)[:3], b.view(-1)[:3]))


def verify_checksum_max(model):  # one checksum, its largest value over ranks compared with rank 0's
    c = torch.stack([p.detach().sum() for p in model.parameters()]).sum().reshape(1)
    c0, cmax = c.clone(), c.clone()
    dist.broadcast(c0, src=0)
    dist.all_reduce(cmax, op=dist.ReduceOp.MAX)
    if not torch.equal(cmax, c0):
        raise ValueError("replicas differ")


def verify_by_broadcast(model):
    for p in model.parameters():
        dist.broadcast(p.data, src=0)


SEED = {
    "right: package": ("check_seed_verification",
                       lambda: __import__("ddp_lib.ddp.simple", fromlist=["x"]).verify_identical_parameters),
    "right: one vector, MAX flag": ("check_seed_verification", lambda: verify_vector),
    "allclose": ("check_seed_verification", lambda: verify_allclose),
    "a sample of values": ("check_seed_verification", lambda: verify_sample),
    "checksum compared with MAX": ("check_seed_verification", lambda: verify_checksum_max),
    "verdict not shared": ("check_seed_verification", lambda: verify_local_verdict),
    "broadcast instead": ("check_seed_verification", lambda: verify_by_broadcast),
}


# ------------------------------------------------------------------------------ lesson 03: accumulation
def accum_solution(ddp, micro_batches, loss_fn):
    n = len(micro_batches)
    for x, y in micro_batches[:-1]:
        with ddp.no_sync():
            (loss_fn(ddp(x), y) / n).backward()
    x, y = micro_batches[-1]
    (loss_fn(ddp(x), y) / n).backward()
    ddp.sync_gradients()


def accum_toggle(ddp, micro_batches, loss_fn):  # right, another way: one context per micro-batch, finish()
    from contextlib import nullcontext

    for i, (x, y) in enumerate(micro_batches):
        with (nullcontext() if i == len(micro_batches) - 1 else ddp.no_sync()):
            loss = loss_fn(ddp(x), y) * (1.0 / len(micro_batches))
            loss.backward()
    ddp.finish_gradient_synchronization()


def accum_forward_outside(ddp, micro_batches, loss_fn):  # no_sync around backward only
    n = len(micro_batches)
    for x, y in micro_batches[:-1]:
        loss = loss_fn(ddp(x), y) / n
        with ddp.no_sync():
            loss.backward()
    x, y = micro_batches[-1]
    (loss_fn(ddp(x), y) / n).backward()
    ddp.sync_gradients()


def accum_all_inside_then_sync(ddp, micro_batches, loss_fn):
    with ddp.no_sync():
        for x, y in micro_batches:
            (loss_fn(ddp(x), y) / len(micro_batches)).backward()
    ddp.sync_gradients()


def accum_first_synced(ddp, micro_batches, loss_fn):  # the off-by-one: the first micro-batch outside no_sync
    n = len(micro_batches)
    x, y = micro_batches[0]
    (loss_fn(ddp(x), y) / n).backward()
    for x, y in micro_batches[1:]:
        with ddp.no_sync():
            (loss_fn(ddp(x), y) / n).backward()
    ddp.sync_gradients()


ACCUM = {
    "right: solution": ("check_accumulation", lambda: accum_solution),
    "right: nullcontext and finish": ("check_accumulation", lambda: accum_toggle),
    "sync every micro-batch": ("check_accumulation", lambda: accum_sync_every_micro_batch),
    "no division": ("check_accumulation", lambda: accum_no_division),
    "forward outside no_sync": ("check_accumulation", lambda: accum_forward_outside),
    "all inside no_sync, then sync": ("check_accumulation", lambda: accum_all_inside_then_sync),
    "first micro-batch synced": ("check_accumulation", lambda: accum_first_synced),
}


# --------------------------------------------------------------------------------- lesson 04: engines
class FlatForeachDDP(LearnerDDP):
    """Right, another way: one flat buffer per dtype, `_foreach_div_` after the sum."""

    def finish_gradient_synchronization(self):
        if not self._sync:
            return
        by_dtype = {}
        for p in self._trainable():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            parts = list(flat.split([g.numel() for g in grads]))
            torch._foreach_div_(parts, dist.get_world_size())
            for g, part in zip(grads, parts):
                g.copy_(part.view_as(g))


class NoBroadcast(LearnerDDP):
    broadcast = False


class BroadcastsTrainableOnly(LearnerDDP):  # frozen weights left as each rank's seed made them
    broadcast = False

    def __init__(self, module):
        super().__init__(module)
        for p in module.parameters():
            if p.requires_grad:
                dist.broadcast(p.data, src=0)


class NoDivision(LearnerDDP):
    divide_before = False


class DividesTwice(LearnerDDP):
    divide_after = True


class NoSyncNeverRestored(LearnerDDP):  # leaves the flag off after the block: the last step never syncs
    @contextmanager
    def no_sync(self):
        self._sync = False
        yield


class SkipsNone(LearnerDDP):
    def finish_gradient_synchronization(self):
        for p in self._trainable():
            if p.grad is not None:
                p.grad /= dist.get_world_size()
                dist.all_reduce(p.grad)


ENGINE = {f"{'right: ' if c in (LearnerDDP, FlatForeachDDP) else ''}{c.__name__}": ("check_engine", (lambda c=c: c))
          for c in (LearnerDDP, FlatForeachDDP, NoBroadcast, BroadcastsTrainableOnly, NoDivision, DividesTwice,
                    NoSyncNeverRestored, SkipsNone)}

# ----------------------------------------------------------------------- lesson 01: the timing loop
def time_allreduce(x, iters, warmup, barrier=True, slowest="per call", warm=True, scale=1.0, total=False):
    """The lesson's solution, with switches for the planted mistakes."""
    def drain():
        if x.is_cuda:
            torch.cuda.synchronize(x.device)

    for _ in range(warmup if warm else 0):
        dist.all_reduce(x)
    drain()
    times = []
    for _ in range(iters):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        drain()
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64, device=x.device)
    if slowest == "per call":
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    elif slowest == "mean over ranks":
        dist.all_reduce(t)
        t /= dist.get_world_size()
    value = t.sum().item() if total else t.median().item()
    return value * scale


def time_gather_max(x, iters, warmup):  # right, another way: each rank's median, then all_gather and max
    import statistics

    for _ in range(warmup):
        dist.all_reduce(x)
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    mine = torch.tensor([statistics.median(times)], dtype=torch.float64)
    every = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return max(float(e) for e in every)


TIMING = {
    "right: solution": ("check_allreduce_timing", lambda: time_allreduce),
    "right: all_gather, then max": ("check_allreduce_timing", lambda: time_gather_max),
    "no warm-up": ("check_allreduce_timing", lambda: lambda x, i, w: time_allreduce(x, i, w, warm=False)),
    "no barrier": ("check_allreduce_timing", lambda: lambda x, i, w: time_allreduce(x, i, w, barrier=False)),
    "this rank's own time": ("check_allreduce_timing", lambda: lambda x, i, w: time_allreduce(x, i, w, slowest="")),
    "mean over ranks": ("check_allreduce_timing",
                        lambda: lambda x, i, w: time_allreduce(x, i, w, slowest="mean over ranks")),
    "milliseconds": ("check_allreduce_timing", lambda: lambda x, i, w: time_allreduce(x, i, w, scale=1e3)),
    "the total": ("check_allreduce_timing", lambda: lambda x, i, w: time_allreduce(x, i, w, total=True)),
}


SUITES = {"get": GET, "ring": RING, "sync": SYNC, "counted": COUNTED, "seed": SEED, "accum": ACCUM, "engine": ENGINE,
          "timing": TIMING}


# ------------------------------------------------------------------------------------------ the ranks
def run_all(suites: list[str] | None = None) -> dict:
    """On each rank: every case of `suites` (default: all) in order; then one all-reduce on the default group."""
    import ddp_lib.check as check
    from ddp_lib.check.allreduce_timing import check_allreduce_timing

    checkers = {"check_get": check.check_get, "check_ring_allreduce": check.check_ring_allreduce,
                "check_sync": check.check_sync, "check_seed_verification": check.check_seed_verification,
                "check_sync_calls": lambda fn, timeout_s: check.check_sync(fn, timeout_s, returns_calls=True),
                "check_accumulation": check.check_accumulation, "check_engine": check.check_engine,
                "check_allreduce_timing": check_allreduce_timing}
    return run_suites(SUITES, checkers, LIMIT_S, suites)


@pytest.fixture(scope="module")
def results():
    return spawn(run_all, 2, backend="gloo", timeout_s=300)


MISTAKES = [  # (suite, planted mistake, the property it fails, words of its diagnosis)
    ("get", "lrank is the global rank", "grank global, lrank node-local", "simulated"),
    ("get", "grank from the mesh", "grank global, lrank node-local", 'get("grank", dm, "tp")'),
    ("get", "ws of the whole mesh", "2-D mesh: one group per dimension", 'get("ws", dm, \'tp\')'),
    ("get", "rank always global", "2-D mesh: one group per dimension", 'get("rank", dm, \'tp\')'),
    ("get", "pg always the world", "2-D mesh: one group per dimension", "is its group"),
    ("get", "ws from LOCAL_WORLD_SIZE", "no mesh: the world", 'get("ws") (simulated'),
    ("get", "rank is LOCAL_RANK", "no mesh: the world", 'get("rank") (simulated'),
    ("ring", "isend then blocking recv", "send and receive posted together", "on NCCL this can deadlock: post the send "
     "and the receive together (dist.batch_isend_irecv)"),
    ("ring", "irecv and isend unbatched", "send and receive posted together", "on NCCL this can deadlock"),
    ("ring", "send request never waited", "every request waited", "isend to rank"),
    ("ring", "overwrites instead of adding", "sum on every rank", "sum off by"),
    ("ring", "out of place", "in place", "x does not hold the sum"),
    ("ring", "dist.all_reduce", "point-to-point only", "all_reduce"),
    ("sync", "no division", "grads averaged (= one process)", "summed, not divided"),
    ("sync", "divides twice", "grads averaged (= one process)", "divided twice?"),
    ("sync", "reduces the weights", "weights untouched", "weight"),
    ("sync", "skips a None grad", "grad None on one rank", ""),
    ("sync", "frozen given a grad", "frozen params skipped", "was given a gradient"),
    ("counted", "returns nothing", "returns its all-reduce count", "returned None"),
    ("counted", "counts frozen params", "returns its all-reduce count", "but issued"),
    ("counted", "flat counts tensors", "returns its all-reduce count", "but issued 1"),
    ("counted", "no division", "grads averaged (= one process)", "summed, not divided"),
    ("counted", "divides twice", "grads averaged (= one process)", "divided twice?"),
    ("seed", "allclose", "one differing value found", "accepted replicas that differ"),
    ("seed", "a sample of values", "one differing value found", "accepted replicas that differ"),
    ("seed", "checksum compared with MAX", "swapped values found", "accepted replicas that differ"),
    ("seed", "verdict not shared", "different seeds refused on every rank", ""),
    ("seed", "broadcast instead", "different seeds refused on every rank", ""),
    ("accum", "sync every micro-batch", "one sync per step (no_sync silent)", "collectives per optimizer step"),
    ("accum", "no division", "equals the big batch", "not divided by their number"),
    ("accum", "forward outside no_sync", "a hook engine agrees (forward inside no_sync)", "forward ran outside"),
    ("accum", "all inside no_sync, then sync", "a hook engine agrees (forward inside no_sync)", "inside no_sync()"),
    ("accum", "first micro-batch synced", "a hook engine agrees (forward inside no_sync)", "must be the last"),
    ("engine", "NoBroadcast", "replicas start equal", "replicas from different seeds"),
    ("engine", "NoDivision", "equal to one process", "summed, not divided"),
    ("engine", "DividesTwice", "equal to one process", "divided twice?"),
    ("engine", "BroadcastsTrainableOnly", "replicas start equal", "replicas from different seeds"),
    ("engine", "NoSyncNeverRestored", "no_sync silent (= big batch)", "accumulating"),
    ("engine", "SkipsNone", "unused parameter", ""),
    ("timing", "no warm-up", "warm-up calls first", "no warm-up call"),
    ("timing", "no barrier", "a barrier before each timed call", "no dist.barrier()"),
    ("timing", "this rank's own time", "the slowest rank decides", "not the slowest rank's time"),
    ("timing", "mean over ranks", "the slowest rank decides", "not the slowest rank's time"),
    ("timing", "milliseconds", "agrees with the package's benchmark", "the package's benchmark"),
    ("timing", "the total", "agrees with the package's benchmark", "the package's benchmark"),
]


# what every mutation suite asserts on its results (one copy: tests/_mutations.py)
(test_same_verdict_on_every_rank_and_group_intact, test_right_answers_written_another_way_pass,
 test_planted_mistake_fails_its_property_with_one_diagnosis, test_suites_are_big_enough) = suite_tests(SUITES, MISTAKES)


def test_dependent_properties_wait_for_the_one_that_failed(results):
    rows = results[0]["sync", "no division"]["rows"]
    assert rows["frozen params skipped"][:2] == ("not checked", "needs grads averaged (= one process) first")
    assert rows["grad None on one rank"][0] == "not checked"


def test_hints_agree_with_the_lessons(results):
    counted = results[0]["counted", "no division"]["rows"]["grads averaged (= one process)"][2]
    assert "lesson 04 divides first" in counted
    engine = results[0]["engine", "NoDivision"]["rows"]["equal to one process"][2]
    assert "divide first" in engine and "afterwards" not in engine
    ring = results[0]["ring", "isend then blocking recv"]["rows"]["send and receive posted together"][2]
    assert "batch_isend_irecv" in ring
