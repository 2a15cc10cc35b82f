"""Time on a profiler's spans: which spans are communication, and how much of a step's wall time had a collective in
flight, compute running, both (communication hidden) or communication alone (exposed).

Pure arithmetic on (start, end) intervals, no profiler: `ddp_lib.kit.profiling.profile_steps` feeds it the events of a
torch.profiler run, and the profiling checkers and tests call it on spans they build.
"""

from __future__ import annotations

import bisect

COMM_KEYS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast")
# labels, not work: the profiler's step ranges, the course's regions, and torch's optimizer annotations
# (`Optimizer.step#AdamW.step`, `Optimizer.zero_grad#...`), which kineto also records on the GPU's timeline around the
# kernels they launch: counted as work, they double the kernels' time and top a table sorted by GPU time
LABELS = ("ProfilerStep", "ddp.", "train.", "Optimizer.")


def is_label(name: str) -> bool:
    """A span that labels a region of work (a step, a phase, an optimizer call) rather than doing any."""
    return name.startswith(LABELS)


def is_comm(name: str) -> bool:
    """A collective run by the backend (gloo:/nccl:/c10d:: ops, nccl kernels); not our own "ddp.*" labels."""
    n = name.lower()
    if n.startswith(("ddp.", "train.", "profilerstep", "aten::")):  # aten:: ops compute (aten::broadcast_tensors)
        return False
    return n.startswith("nccl") or any(k in n for k in COMM_KEYS)


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The time `spans` cover, as sorted disjoint (start, end) intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(spans: list[tuple[float, float]]) -> float:
    """How long disjoint `spans` last in all."""
    return sum(b - a for a, b in spans)


def intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """How long two sorted disjoint interval lists (two `union`s) cover the same time."""
    both, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        both += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
        i, j = (i + 1, j) if x[i][1] < y[j][1] else (i, j + 1)
    return both


def comm_compute_split(spans: list[tuple[str, float, float]], windows: list[tuple[float, float]]) -> dict[str, float]:
    """Per profiled step, in ms: the wall time with a collective in flight (`comm_ms`), with compute running
    (`compute_ms`), both at once (`hidden_ms`: communication hidden behind compute) and communication alone
    (`exposed_ms` = comm - hidden: what the step waits for).

    `spans`: the profiler's events as (name, start_us, end_us); `windows`: each profiled step's (start_us, end_us).
    Labels (`ProfilerStep*`, the `ddp.*` and `train.*` regions, `Optimizer.*` annotations: `is_label`) are not work and are skipped; a collective is what
    `is_comm` names one. Spans nest and overlap (an operator inside another, two all-reduces in flight), so time is
    counted on the union of spans, clipped to the step windows: a microsecond is counted once, however many
    events cover it.
    """
    return _split(*_work_unions(spans), windows)


def comm_compute_per_window(spans: list[tuple[str, float, float]],
                            windows: list[tuple[float, float]]) -> list[dict[str, float]]:
    """`comm_compute_split` of each window on its own (`[comm_compute_split(spans, [w]) for w in windows]`), with
    the spans sorted and merged once instead of once per window: a profile holds tens of thousands of spans."""
    return _per_window(*_work_unions(spans), windows)


def comm_compute_split_and_per_window(spans: list[tuple[str, float, float]], windows: list[tuple[float, float]]
                                      ) -> tuple[dict[str, float], list[dict[str, float]]]:
    """`comm_compute_split` over all the windows and `comm_compute_per_window`, from one sort and merge of the
    spans: what `ddp_lib.kit.profiling.profile_steps` reports (the mean step and each step on its own)."""
    comm_u, compute_u = _work_unions(spans)
    return _split(comm_u, compute_u, windows), _per_window(comm_u, compute_u, windows)


def _per_window(comm_u: list[tuple[float, float]], compute_u: list[tuple[float, float]],
                windows: list[tuple[float, float]]) -> list[dict[str, float]]:
    """`_split` of each window on its own."""
    return [_split(comm_u, compute_u, [w]) for w in windows]


def _work_unions(spans: list[tuple[str, float, float]]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The time the collectives cover and the time compute covers, each as a `union` (labels skipped)."""
    comm, compute = [], []
    for name, start, end in spans:
        if is_label(name):
            continue
        (comm if is_comm(name) else compute).append((start, end))
    return union(comm), union(compute)


def _clip(u: list[tuple[float, float]], windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of disjoint sorted intervals `u` inside the windows, as a `union`."""
    ends = [b for _, b in u]
    out = []
    for s, t in windows:
        for i in range(bisect.bisect_right(ends, s), len(u)):  # from the first interval ending after the window opens
            a, b = u[i]
            if a >= t:
                break
            out.append((max(a, s), min(b, t)))
    return union(out)


def _split(comm_u: list[tuple[float, float]], compute_u: list[tuple[float, float]],
           windows: list[tuple[float, float]]) -> dict[str, float]:
    """`comm_compute_split`'s figures from the two unions, clipped to `windows`."""
    comm_u, compute_u = _clip(comm_u, windows), _clip(compute_u, windows)
    n = max(1, len(windows))
    hidden = intersection(comm_u, compute_u)
    return {"comm_ms": length(comm_u) / 1e3 / n, "compute_ms": length(compute_u) / 1e3 / n,
            "hidden_ms": hidden / 1e3 / n, "exposed_ms": (length(comm_u) - hidden) / 1e3 / n}


def minus(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of disjoint intervals `x` that no interval of disjoint `y` covers."""
    out: list[tuple[float, float]] = []
    for a, b in x:
        for c, d in y:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
            if a >= b:
                break
        if b > a:
            out.append((a, b))
    return out


def exposed_breakdown(spans: list[tuple[str, float, float]],
                      windows: list[tuple[float, float]]) -> dict[str, float] | None:
    """Where the exposed communication of each profiled step lies, in ms per step: inside the engine's `ddp.wait`
    (`in_wait_ms`), outside it inside the `c10d::` calls that launch collectives (`launching_ms`), elsewhere
    (`between_ops_ms`: gaps between operators); and the wait's time with no collective in flight (`idle_wait_ms`).

    None when the spans hold no `ddp.wait` label, so a caller says it was not measured instead of guessing. Meant
    for host-timed profiles (CPU ranks): on GPU ranks the wait is a stream dependency, not a host range, and
    `profile_steps` keeps device spans only, so callers skip it there (`ProfileResult.phase_clock != "host"`).
    """
    clip = lambda s: union([(max(a, p), min(b, q)) for a, b in s for p, q in windows  # noqa: E731
                            if min(b, q) > max(a, p)])
    waits = clip([(a, b) for n, a, b in spans if n == "ddp.wait"])
    if not waits:
        return None
    work = [(n, a, b) for n, a, b in spans if not n.startswith(("ProfilerStep", "ddp.", "train."))]
    comm = clip([(a, b) for n, a, b in work if is_comm(n)])
    compute = clip([(a, b) for n, a, b in work if not is_comm(n)])
    launches = clip([(a, b) for n, a, b in work if n.startswith("c10d::")])
    exposed = minus(comm, compute)
    outside = minus(exposed, waits)
    n = max(1, len(windows)) * 1e3
    launching = intersection(outside, launches)
    return {"in_wait_ms": (length(exposed) - length(outside)) / n, "launching_ms": launching / n,
            "between_ops_ms": (length(outside) - launching) / n, "idle_wait_ms": length(minus(waits, comm)) / n}


def idle_share(spans: list[tuple[str, float, float]], windows: list[tuple[float, float]]) -> float:
    """The share of the step windows in which none of `spans` (labels skipped) ran: on a GPU's kernels, the time the
    GPU sat idle waiting for the host (a host-bound step: Python, launches, the data loader); 0 with no windows."""
    work = [(a, b) for name, a, b in spans if not is_label(name)]
    busy = union([(max(a, s), min(b, t)) for a, b in work for s, t in windows if min(b, t) > max(a, s)])
    total = length(union(windows))
    return 1.0 - length(busy) / total if total else 0.0
