"""Lesson 06's checker: `check_exposed_comm(fn)`, the exposed communication read out of the profiler's events.

`fn(spans, windows)` gets the profiler's events as `(name, start_us, end_us)` and each profiled step's window
`(start_us, end_us)`, and returns the milliseconds per step during which a collective was in flight while no compute
ran: the communication the step waits for. Hand-made timelines test one rule each (labels are not work, spans
that overlap count once, compute hides communication, the windows clip and divide); then the answer is compared
with the package's `ddp_lib.kit.profiling.comm_compute_split` on a real profile of a small bucketed DDP step, taken on
every rank before the properties run.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, schedule

from ddp_lib.check._runner import CheckResult, Mismatch, Property, learner_namespaces, run_check
from ddp_lib.kit.profiling import comm_compute_split, without_kineto_noise
from ddp_lib.devices import needs_process_group

AR, MM = "gloo:all_reduce", "aten::mm"  # a collective and a compute op, as the profiler names them on gloo


def _real_profile() -> tuple[list[tuple[str, float, float]], list[tuple[float, float]]]:
    """Two profiled steps of a small BucketedDDP model (several buckets in flight during backward), this rank."""
    from ddp_lib.ddp import BucketedDDP
    from ddp_lib.devices import rank_device

    device = rank_device()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    ddp = BucketedDDP(model, bucket_size_mb=0.1, first_bucket_mb=0.1)
    x = torch.randn(64, 64, device=device)
    with without_kineto_noise(), profile(activities=[ProfilerActivity.CPU],
                                         schedule=schedule(wait=0, warmup=1, active=2, repeat=1)) as prof:
        for _ in range(3):
            ddp(x).pow(2).mean().backward()
            ddp.finish_gradient_synchronization()
            prof.step()
    events = prof.events()
    windows = sorted((e.time_range.start, e.time_range.end) for e in events if e.name.startswith("ProfilerStep"))
    spans = [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events]
    del ddp, model
    return spans, windows


@needs_process_group
def check_exposed_comm(fn: Callable[[list, list], float], timeout_s: float | None = None,
                       quiet: bool = False) -> CheckResult:
    """`fn(spans, windows)` returns the exposed communication in ms per step (see the module's docstring)."""
    e = _ExposedComm(fn)
    first = ("one all-reduce, in ms",)
    props = [
        Property("one all-reduce, in ms", e.alone,
                 "the time an all-reduce is in flight and no compute runs, in ms per step (events are in us)"),
        Property("labels are not work", e.labels,
                 "skip ProfilerStep*, train.* and ddp.*: they are regions around work, not compute", needs=first),
        Property("overlapping collectives count once", e.union,
                 "merge the collectives' spans into a union before measuring: two in flight at once are not twice "
                 "the time", needs=first),
        Property("compute hides communication", e.hidden,
                 "subtract the time where communication and compute (the union of the compute spans: they nest) "
                 "overlap", needs=first),
        Property("clipped to the steps, per step", e.clipped,
                 "count only time inside the step windows, then divide by the number of steps", needs=first),
        Property("agrees with profile_steps on a real profile", e.profiled,
                 "ddp_lib.kit.profiling.comm_compute_split gives the package's answer on the same events",
                 needs=("labels are not work", "overlapping collectives count once", "compute hides communication",
                        "clipped to the steps, per step")),
    ]
    return run_check("exposed communication", props, timeout_s, learner_namespaces(fn), quiet)


class _ExposedComm:
    """The setup (the learner's fn, a real profile) and one method per property's evidence: hand-built spans with
    the exposed time they must give."""

    def __init__(self, fn: Callable[[list, list], float]) -> None:
        self.fn = fn
        self.real = _real_profile()  # before the properties: the package's own collectives, the same on every rank

    def ask(self, spans, wins, want: float, what: str) -> float:
        got = self.fn(list(spans), list(wins))
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, (int, float)):
            raise Mismatch(f"returned {got!r}: return the milliseconds per step, a float")
        diff = abs(got - want)
        if diff > 1e-6 * max(1.0, abs(want)):
            raise Mismatch(f"{what}: {got:.4g} ms, expected {want:.4g} ms", diff)
        return diff

    def alone(self) -> float:  # one step of 10 ms; an all-reduce of 4 ms, nothing else
        got = self.fn([(AR, 2_000.0, 6_000.0)], [(0.0, 10_000.0)])
        if isinstance(got, (int, float)) and abs(got - 4_000.0) < 1e-3:
            raise Mismatch("4000 for an all-reduce of 4000 us: the profiler counts microseconds, return ms", 3996.0)
        return self.ask([(AR, 2_000.0, 6_000.0)], [(0.0, 10_000.0)], 4.0, "one all-reduce of 4 ms, no compute")

    def labels(self) -> float:  # our regions cover everything, yet they are not work
        spans = [("ProfilerStep#1", 0.0, 10_000.0), ("train.backward", 500.0, 9_000.0), ("ddp.wait", 2_000.0, 6_000.0),
                 (AR, 2_000.0, 6_000.0), (MM, 500.0, 1_500.0)]
        return self.ask(spans, [(0.0, 10_000.0)], 4.0, "labels (ProfilerStep*, train.*, ddp.*) around an all-reduce")

    def union(self) -> float:  # two all-reduces in flight at once: 1..5 ms and 3..7 ms, 6 ms of communication
        spans = [(AR, 1_000.0, 5_000.0), (AR, 3_000.0, 7_000.0)]
        return self.ask(spans, [(0.0, 10_000.0)], 6.0, "two all-reduces in flight together (1-5 ms and 3-7 ms)")

    def hidden(self) -> float:  # compute nested and overlapping: mm 0..4 with a nested op 2.5..3.5, another 5..6
        spans = [(AR, 2_000.0, 8_000.0), (MM, 0.0, 4_000.0), ("aten::add", 2_500.0, 3_500.0),
                 ("aten::relu", 3_000.0, 4_500.0), (MM, 5_000.0, 6_000.0)]
        # comm 2..8 (6 ms); compute 0..4.5 and 5..6: hides 2..4.5 and 5..6 (3.5 ms); exposed 2.5 ms
        return self.ask(spans, [(0.0, 10_000.0)], 2.5, "an all-reduce (2-8 ms) partly behind nested compute")

    def clipped(self) -> float:  # two steps; an all-reduce from the warm-up spills into step 1, one runs between steps
        spans = [(AR, -3_000.0, 1_000.0), (AR, 10_500.0, 11_500.0), (AR, 14_000.0, 16_000.0)]
        # step 1 (0..10 ms): 0..1 (1 ms); between the steps: not counted; step 2 (12..22 ms): 14..16 (2 ms)
        return self.ask(spans, [(0.0, 10_000.0), (12_000.0, 22_000.0)], 1.5,
                        "two steps, an all-reduce spilling in from before and one between them")

    def profiled(self) -> float:
        spans, wins = self.real
        want = comm_compute_split(spans, wins)["exposed_ms"]
        return self.ask(spans, wins, want, f"a real profile of 2 bucketed DDP steps ({len(spans)} events)")
