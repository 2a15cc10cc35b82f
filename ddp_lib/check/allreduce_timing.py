"""Lesson 01's second checker: `check_allreduce_timing(fn)`, the learner's all-reduce timing loop.

`fn(x, iters, warmup)` all-reduces `x` `warmup` times untimed, then `iters` times timed, following the lesson's
rules, and returns the seconds per call that the slowest rank saw (the median over the timed calls). While it
runs, `dist.all_reduce` and `dist.barrier` are wrapped: each call is recorded in order, then made for real. For
one property the last rank sleeps after each of its all-reduces of `x` (inside its timed region), so that an
answer reporting each rank's own clock, or an average over ranks, shows on the fast rank. On CUDA, for another,
every rank's GPU is kept busy after each all-reduce of `x` (`torch.cuda._sleep`, queued behind the collective; the host
goes on), so that an answer reading the host clock before the device drained (no `torch.cuda.synchronize()`, no
event synchronized) reads near zero, as NCCL's `wait()` does not block the host. Finally the answer is
compared with the package's benchmark (`ddp_lib.bench.allreduce_rank_bench`, run by the check on every rank
after the learner's function) on the same size, within a factor of `BAND`: wide, as one call on a busy shared CPU
can take several times another, yet narrow enough for the mistakes it is there for (milliseconds: 1000x; the
total of the `AGREE_ITERS` timed calls: 40x).
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddp_lib.check._collective_guard import swap_in
from ddp_lib.check._runner import CheckResult, Mismatch, Property, learner_namespaces, run_check
from ddp_lib.devices import comm_device, needs_process_group

DELAY_S = 0.05  # the last rank's extra time per call in "the slowest rank decides"
SPIN_S = 0.05  # the device's extra time per call in "the device drained" (CUDA only)
# torch.cuda._sleep's unit is GPU clock cycles: at the fastest SM clocks (about 2 GHz) SPIN_S of them spin for at
# least SPIN_S; a slower clock spins longer, which that property's lower bound allows
SPIN_HZ = 2.0e9
BAND = 8.0  # the answer and the package's benchmark agree within this factor (2-core CI under load: 3.1x seen)
AGREE_ITERS = 40  # timed calls in that comparison: an answer that returns their total is off by 40x


class _Watch:
    """Wrap dist.all_reduce and dist.barrier in `spaces`: record the order of barriers and calls on `x`."""

    def __init__(self, x: torch.Tensor, delay_s: float, spin_s: float = 0.0):
        self.x, self.delay_s, self.spin_s, self.events = x, delay_s, spin_s, []

    def install(self, spaces: list[dict]) -> list[tuple[dict, str, object]]:
        real = {"all_reduce": dist.all_reduce, "barrier": dist.barrier}
        w = self

        def all_reduce(tensor, *args, **kwargs):
            out = real["all_reduce"](tensor, *args, **kwargs)
            if tensor.data_ptr() == w.x.data_ptr():
                w.events.append("call")
                if w.delay_s:
                    time.sleep(w.delay_s)  # this rank is slow: inside its own timed region
                if w.spin_s:  # the device is busy after the collective; the host goes on
                    torch.cuda._sleep(int(w.spin_s * SPIN_HZ))
            return out

        def barrier(*args, **kwargs):
            w.events.append("barrier")
            return real["barrier"](*args, **kwargs)

        return swap_in(spaces, real, {"all_reduce": all_reduce, "barrier": barrier})


@needs_process_group
def check_allreduce_timing(fn: Callable[[torch.Tensor, int, int], float], timeout_s: float | None = None,
                           quiet: bool = False) -> CheckResult:
    """`fn(x, iters, warmup)` returns the seconds per all-reduce of `x`: warm-up calls untimed, a barrier
    before each timed call, the device drained on CUDA, the slowest rank's time, the median over calls."""
    t = _Timing(fn)
    props = [
        Property("warm-up calls first", t.counts,
                 "all-reduce x `warmup` times untimed before the `iters` timed calls: a first call pays one-off costs"),
        Property("a barrier before each timed call", t.barriers,
                 "dist.barrier() before reading the clock for each call, so that no rank times its wait for another",
                 needs=("warm-up calls first",)),
        Property("the slowest rank decides", t.slowest,
                 "all-reduce the times with op=dist.ReduceOp.MAX (outside the timed region): the call is done for "
                 "the job when its last rank is done", needs=("warm-up calls first",)),
        Property("the device drained", t.drained,
                 "on CUDA, torch.cuda.synchronize() after the all-reduce, before reading the clock (or CUDA events "
                 "recorded around it, the end one synchronized): NCCL's wait does not block the host",
                 needs=("warm-up calls first",)),
        Property("agrees with the package's benchmark", t.agrees,
                 "return seconds per call (the median over the timed calls), not the total nor milliseconds",
                 needs=("a barrier before each timed call", "the slowest rank decides", "the device drained")),
    ]
    return run_check("all-reduce timing", props, timeout_s, learner_namespaces(fn), quiet,
                     warm_up=False)  # no optimizer in the properties


class _Timing:
    """The setup (the learner's fn, this rank, the device), the watched run every property reads, and one method
    per property's evidence."""

    def __init__(self, fn: Callable[[torch.Tensor, int, int], float]) -> None:
        self.fn = fn
        self.rank, self.ws = dist.get_rank(), dist.get_world_size()
        self.device = comm_device()
        self.seen: dict = {}

    def timed(self, numel: int, iters: int, warmup: int, delay_s: float = 0.0, spin_s: float = 0.0
              ) -> tuple[float, list[str]]:
        x = torch.ones(numel, device=self.device)
        watch = _Watch(x, delay_s if self.rank == self.ws - 1 else 0.0, spin_s)
        restore = watch.install([vars(dist), vars(c10d), getattr(self.fn, "__globals__", {})])
        try:
            out = self.fn(x, iters, warmup)
        finally:
            for space, key, value in reversed(restore):
                space[key] = value
        if isinstance(out, torch.Tensor) and out.numel() == 1:
            out = out.item()
        if not isinstance(out, (int, float)) or not out > 0:
            raise Mismatch(f"returned {out!r}: return the seconds per call, a positive float")
        return float(out), watch.events

    def counts(self) -> None:
        iters, warmup = 5, 3
        _, events = self.timed(16 * 1024, iters, warmup)
        calls = events.count("call")
        self.seen["events"] = events
        if calls == iters:
            raise Mismatch(f"{calls} all-reduces of x, all of them timed: no warm-up call before the timed ones")
        if calls != iters + warmup:
            raise Mismatch(f"{calls} all-reduces of x, expected warmup + iters = {warmup + iters}")

    def barriers(self) -> None:
        events, iters = self.seen["events"], 5
        positions = [i for i, e in enumerate(events) if e == "call"]
        timed_calls = positions[-iters:]
        previous = [positions[-iters - 1]] + timed_calls[:-1]
        missing = sum(1 for a, b in zip(previous, timed_calls) if "barrier" not in events[a + 1:b])
        if missing:
            raise Mismatch(f"{missing} of {iters} timed calls had no dist.barrier() since the call before")

    def slowest(self) -> float:
        got, _ = self.timed(16 * 1024, 3, 1, delay_s=DELAY_S)
        if got < 0.9 * DELAY_S:
            raise Mismatch(f"returned {got * 1e3:.1f} ms while rank {self.ws - 1} took over {DELAY_S * 1e3:.0f} ms per "
                           "call: not the slowest rank's time (this rank's own? an average over ranks?)")
        return None

    def drained(self) -> float | None:
        if self.device.type != "cuda":
            return None  # on the CPU (gloo) a collective is done when it returns: nothing is left to drain
        got, _ = self.timed(16 * 1024, 3, 1, spin_s=SPIN_S)
        if got < 0.9 * SPIN_S:
            raise Mismatch(f"returned {got * 1e3:.2f} ms while each call kept the GPU busy for over "
                           f"{SPIN_S * 1e3:.0f} ms: the clock was read before the device finished (no "
                           "torch.cuda.synchronize() after the all-reduce?)")
        return None

    def agrees(self) -> float:
        from ddp_lib.bench.allreduce import allreduce_rank_bench

        numel = 2**20 // 4  # 1 MiB
        for attempt in range(2):  # a second measurement when the first is out of the band: a hiccup, or wrong
            got, _ = self.timed(numel, AGREE_ITERS, 3)
            want = allreduce_rank_bench([numel * 4], iters=AGREE_ITERS, warmup=3, budget_s=1.0)[0]["time_us"] * 1e-6
            ratio = got / want
            if 1 / BAND <= ratio <= BAND:
                break
        else:
            raise Mismatch(f"1 MiB: {got * 1e6:.0f} us per call, the package's benchmark {want * 1e6:.0f} us "
                           f"({ratio:.2g}x; seconds per call, not in total or in ms?)", abs(ratio - 1))
        return abs(ratio - 1)
