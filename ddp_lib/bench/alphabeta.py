"""The α–β cost model of a collective, T(n) = α + β·n, and the bucket size it predicts for overlapped DDP.

α is the fixed cost of one all-reduce call (latency: launch, handshakes, the ring's 2(p-1) steps of
start-up); β is the cost per byte (1/β is the effective bandwidth). Fitted by ordinary least squares
(weighted by 1/T², i.e. relative error, by default) on measured (size, time) pairs, separately for each
(backend, world size). Lesson 01 (or `python -m ddp_lib.bench allreduce --fit-json`) fits it once and saves it
with `save_fits`; lessons 04 and 05 read it back with `ddp_lib.bench.fit_here.fit_or_measure`, which measures
one in place when none was saved.

Best bucket size for bucketed all-reduce overlapped with backward (derivation)
------------------------------------------------------------------------------
Assume backward takes B seconds and produces the N gradient bytes at a steady rate r = N/B, and that
the gradients are cut into k = N/b buckets of b bytes. Bucket j is full at t_j = j·b/r = j·B/k and its
all-reduce costs c = α + β·b. The model runs them one after another in a fixed order (as NCCL does on one
stream; gloo's two worker threads can run two at once), so the last one ends at

    T_end = max_j ( t_j + (k - j + 1)·c ) = max( B + c ,  B/k + k·c )

(the j-term is linear in j: if a bucket is produced slower than it is reduced, b/r > c, the last
bucket decides; otherwise the first bucket's wait plus k back-to-back collectives decide). The
communication left exposed after backward is E(b) = T_end - B:

    E(b) = max( α + β·b ,  b·B/N + N·α/b + N·β - B )

The first branch grows with b (the last bucket is reduced after backward, nothing to hide it
behind); the second is convex with its minimum at b = N·sqrt(α/B) (fewer calls vs. a later start).
`best_bucket_bytes` minimises E over whole numbers of buckets k = 1..N/min_bytes; in closed form the
optimum is b* = N·sqrt(α/B) when that point is communication-bound, else the crossing of the branches.
If N·β > B the model is communication-bound at every b: no bucketing can hide more than B seconds.
α is what one call costs beyond its bytes: lesson 05 takes the per-call cost it measures (gloo's own work included).

How sure the fit is: `fit_interval` resamples the measured sizes with replacement (a pairs bootstrap), refits
each sample, and reports the central `level` share of α, 1/β and the crossover n* = α/β. A size below the
crossover's interval is latency-bound, above it bandwidth-bound, inside it undecided (`regime`).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable


@dataclass(frozen=True)
class AlphaBeta:
    """T(n) = alpha_s + beta_s_per_byte · n seconds for an all-reduce of n bytes."""

    alpha_s: float
    beta_s_per_byte: float
    alpha_resolved: bool = True  # False: the free fit gave α < 0 (latency below the noise), so α was fixed at 0

    @property
    def alpha_us(self) -> float:
        """Latency α in microseconds."""
        return self.alpha_s * 1e6

    @property
    def bandwidth_GBps(self) -> float:
        """Effective bandwidth 1/β in GB/s (1 GB = 1e9 bytes), as seen by the caller (algbw at large n)."""
        return 1.0 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else math.inf

    def time_s(self, n_bytes: float) -> float:
        """Predicted all-reduce time of n bytes, in seconds."""
        return self.alpha_s + self.beta_s_per_byte * n_bytes

    def as_dict(self) -> dict:
        """Fields plus α in µs and bandwidth in GB/s (for JSON)."""
        return {**asdict(self), "alpha_us": self.alpha_us, "bandwidth_GBps": self.bandwidth_GBps}


def fit_alpha_beta(rows: Iterable[dict] | None = None, sizes: Iterable[float] | None = None,
                   times_s: Iterable[float] | None = None, relative: bool = True) -> AlphaBeta:
    """Least-squares fit of T(n) = α + β·n, from allreduce rows (size_bytes, time_us) or from sizes and times.

    relative=True weighs each point by 1/T² (minimises relative error), so the small sizes that carry
    α are not drowned by the large ones; relative=False is plain least squares. Both recover exact data.
    """
    if rows is not None:
        rows = list(rows)
        sizes = [r["size_bytes"] for r in rows]
        times_s = [r["time_us"] * 1e-6 for r in rows]
    xs, ys = [float(s) for s in sizes], [float(t) for t in times_s]
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError("fit_alpha_beta needs measurements at two or more distinct sizes")
    ws = [1.0 / y**2 if relative and y > 0 else 1.0 for y in ys]
    sw = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / sw
    my = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys))
    beta = sxy / sxx
    alpha = my - beta * mx
    if alpha < 0:  # a negative latency is noise, not physics: fit T = β·n through the origin instead
        beta = sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs))
        return AlphaBeta(alpha_s=0.0, beta_s_per_byte=beta, alpha_resolved=False)
    return AlphaBeta(alpha_s=alpha, beta_s_per_byte=beta)


def fit_by_group(rows: Iterable[dict]) -> dict[tuple[str, int], AlphaBeta]:
    """One α–β fit per (backend, world_size) in a list of allreduce rows."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["backend"], r["world_size"]), []).append(r)
    return {k: fit_alpha_beta(v) for k, v in groups.items() if len({r["size_bytes"] for r in v}) >= 2}


def fit_interval(rows: Iterable[dict], level: float = 0.9, n_boot: int = 2000, seed: int = 0) -> dict:
    """`level` intervals of α (µs), 1/β (GB/s) and the crossover n* = α/β (bytes) from a pairs bootstrap.

    Each of `n_boot` resamples draws as many (size, time) rows as were measured, with replacement, and refits
    (samples with fewer than two distinct sizes are skipped); the interval is the central `level` share of the
    refits (quantiles). Exact data give a zero-width interval; scattered points widen it. Deterministic for a seed.
    """
    rows = list(rows)
    if len({r["size_bytes"] for r in rows}) < 2:
        raise ValueError("fit_interval needs measurements at two or more distinct sizes")
    rng = random.Random(seed)
    alphas, bandwidths, crossovers = [], [], []
    for _ in range(n_boot):
        sample = [rng.choice(rows) for _ in rows]
        if len({r["size_bytes"] for r in sample}) < 2:
            continue
        fit = fit_alpha_beta(sample)
        if fit.beta_s_per_byte <= 0:
            continue
        alphas.append(fit.alpha_us)
        bandwidths.append(fit.bandwidth_GBps)
        crossovers.append(fit.alpha_s / fit.beta_s_per_byte)

    def central(xs: list[float]) -> list[float]:
        if len(xs) < 2:
            return [xs[0], xs[0]] if xs else [math.nan, math.nan]
        qs = statistics.quantiles(xs, n=1000, method="inclusive")
        lo = round((1 - level) / 2 * 1000)
        return [qs[lo - 1] if lo > 0 else min(xs), qs[1000 - lo - 1] if lo > 0 else max(xs)]

    return dict(level=level, resamples=len(alphas), alpha_us=central(alphas), bandwidth_GBps=central(bandwidths),
                crossover_bytes=central(crossovers))


def regime(n_bytes: float, interval: dict) -> str:
    """'latency-bound' below the crossover's interval, 'bandwidth-bound' above it, 'near the crossover' inside;
    'no crossover resolved' where a bound is None (a fitted α that is not positive, e.g. timings read as zero)."""
    lo, hi = interval["crossover_bytes"]
    if lo is None or hi is None:
        return "no crossover resolved"
    return "latency-bound" if n_bytes < lo else "bandwidth-bound" if n_bytes > hi else "near the crossover"


def ring_allreduce_s(model: AlphaBeta, n_bytes: float, ranks: int) -> float:
    """A ring all-reduce of n bytes over `ranks`, extrapolated from a 2-rank fit: (p-1)·α + 2(p-1)/p·n·β.

    A ring takes 2(p-1) steps, each moving n/p bytes: T_p = 2(p-1)·α₁ + 2(p-1)/p·n·β₁ with one step's α₁, β₁. At
    p = 2 that is 2α₁ + n·β₁, so a 2-rank fit gives α₁ = α/2 and β₁ = β. Assumes the ring on links like the fitted
    one, without contention; NCCL chooses other algorithms (tree, NVLS) where they are faster.
    """
    if ranks < 2:
        return 0.0
    return (ranks - 1) * model.alpha_s + 2 * (ranks - 1) / ranks * n_bytes * model.beta_s_per_byte


def scaling(model: AlphaBeta, grad_bytes: float, backward_s: float, ranks: Iterable[int]) -> list[dict]:
    """Data-parallel scaling under the ring model (CS336 assignment 2, §8), per number of ranks p:

    comm_s: one all-reduce of the gradients; weak_backward_s: backward at a fixed batch per rank (the measured
    one); strong_backward_s: backward at a fixed global batch (the measured one at 2 ranks, shrinking as 2/p);
    *_exposed_s: what perfect overlap still leaves, max(0, comm - backward); *_efficiency: backward /
    (backward + exposed), the share of the step that is compute when overlap is perfect.
    """
    out = []
    for p in ranks:
        comm = ring_allreduce_s(model, grad_bytes, p)
        row = dict(ranks=p, comm_s=comm)
        for kind, bwd in (("weak", backward_s), ("strong", backward_s * 2 / p)):
            exposed = max(0.0, comm - bwd)
            row.update({f"{kind}_backward_s": bwd, f"{kind}_exposed_s": exposed,
                        f"{kind}_efficiency": bwd / (bwd + exposed) if bwd + exposed > 0 else 1.0})
        out.append(row)
    return out


def exposed_comm_s(bucket_bytes: float, model: AlphaBeta, total_bytes: float, backward_s: float) -> float:
    """Communication left after backward for buckets of `bucket_bytes` (see the module docstring): E(b)."""
    b = min(float(bucket_bytes), float(total_bytes))
    k = max(1, math.ceil(round(total_bytes / b, 9)))  # rounded first: total / (total / k) may be k + 4e-15
    b = total_bytes / k  # k equal buckets
    c = model.time_s(b)
    return max(c, backward_s / k + k * c - backward_s)


def best_bucket_bytes(model: AlphaBeta, total_bytes: float, backward_s: float, min_bytes: float = 4096) -> float:
    """The bucket size (bytes) that minimises the exposed communication E(b) under the α–β model."""
    k_max = max(1, int(total_bytes // max(min_bytes, 1)))
    best_k = min(range(1, k_max + 1), key=lambda k: exposed_comm_s(total_bytes / k, model, total_bytes, backward_s))
    return total_bytes / best_k


def residuals(model: AlphaBeta, rows: Iterable[dict]) -> list[dict]:
    """Per measured row: size, measured and predicted µs, and measured/predicted (1.0 = the model is exact)."""
    out = []
    for r in sorted(rows, key=lambda r: r["size_bytes"]):
        predicted = model.time_s(r["size_bytes"]) * 1e6
        out.append(dict(size_bytes=r["size_bytes"], measured_us=r["time_us"], predicted_us=predicted,
                        ratio=r["time_us"] / predicted if predicted > 0 else math.inf))
    return out


# Where the fit lives: lesson 01 (or `python -m ddp_lib.bench allreduce --fit-json runs/alphabeta_fit.json`)
# writes runs/ (git-ignored, this machine); assets/ holds a committed reference measured on a 2-core CPU VM.
ROOT = Path(__file__).resolve().parents[2]
RUNS_FIT = ROOT / "runs" / "alphabeta_fit.json"
REFERENCE_FIT = ROOT / "assets" / "alphabeta_fit_cpu.json"
ROW_KEYS = ("size_bytes", "time_us", "p25_time_us", "p75_time_us", "min_time_us", "max_time_us", "mean_time_us")


def fit_records(rows: Iterable[dict]) -> list[dict]:
    """One record per (backend, world size) in allreduce rows: the fit, its crossover and interval, its points."""
    rows = list(rows)
    fits = []
    for (backend, ws), fit in sorted(fit_by_group(rows).items()):
        mine = [r for r in rows if (r["backend"], r["world_size"]) == (backend, ws)]
        points = [{k: r[k] for k in ROW_KEYS if k in r} for r in mine]
        sizes = [pt["size_bytes"] for pt in points]
        # n* where α = β·n; none where the times did not grow with size (β <= 0: a sweep too short or too noisy
        # to resolve the bandwidth, as 4-64 KiB on a loaded 2-core machine can be), rather than a negative size
        # or a division by zero
        crossover = fit.alpha_s / fit.beta_s_per_byte if fit.beta_s_per_byte > 0 else None
        fits.append(dict(backend=backend, world_size=ws, **fit.as_dict(), crossover_bytes=crossover,
                         straddles_crossover=crossover is not None and min(sizes) < crossover < max(sizes),
                         interval=fit_interval(mine),
                         rows=points))
    return fits


def save_fits(rows: Iterable[dict], path: str | Path = RUNS_FIT, machine: str = "") -> Path:
    """Fit α–β per (backend, world size) in allreduce rows and write fits plus the points they came from as JSON,
    merged into what `path` holds: a (backend, world size) measured now replaces its old fit, the others stay
    (lesson 01's 4-rank session must not erase its 2-rank fit)."""
    fits = fit_records(rows)
    path = Path(path)
    new = {(f["backend"], f["world_size"]) for f in fits}
    kept = []
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:  # a file this function did not write (renamed into place, never half written)
            old = {}
        carried = {}
        for rec in old.get("fits", []):
            rec = {**rec, "machine": rec.get("machine", old.get("machine", ""))}
            if (rec["backend"], rec["world_size"]) not in new:
                kept.append(rec)
            elif "pipelined" in rec and rec["machine"] == machine:  # a refit of the per-call α keeps this box's
                carried[(rec["backend"], rec["world_size"])] = rec["pipelined"]  # pipelined one (save_pipelined_fit)
    else:
        carried = {}
    fits = [{**f, "machine": machine, **({"pipelined": carried[k]} if (k := (f["backend"], f["world_size"])) in carried
                                         else {})} for f in fits]
    merged = sorted(kept + fits, key=lambda f: (f["backend"], f["world_size"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # then renamed: a reader never sees half a file
    tmp.write_text(json.dumps(dict(machine=machine, fits=merged), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def save_pipelined_fit(rows: Iterable[dict], path: str | Path = RUNS_FIT) -> dict[tuple[str, int], AlphaBeta]:
    """Fit α–β to pipelined all-reduce rows (`allreduce_pipelined_rank_bench`: calls back to back, one synchronize)
    and store each fit as `pipelined` inside the saved per-call record of the same (backend, world size) in `path`
    (`save_fits` first: a group with no per-call record there is not stored). Returns the fits stored."""
    path, rows = Path(path), list(rows)
    data = json.loads(path.read_text())
    fits = fit_by_group(rows)
    stored = {}
    for rec in data["fits"]:
        key = (rec["backend"], rec["world_size"])
        if key in fits:
            mine = [r for r in rows if (r["backend"], r["world_size"]) == key]
            rec["pipelined"] = dict(**fits[key].as_dict(), rows=[{k: r[k] for k in ROW_KEYS if k in r} for r in mine])
            stored[key] = fits[key]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return stored


def as_pipelined(record: dict, pipelined: dict) -> dict:
    """A per-call fit's record describing its pipelined fit instead (α, β, points: what an interval is drawn from);
    the per-call crossover and interval go, since they belong to the other α."""
    per_call_only = ("interval", "crossover_bytes", "straddles_crossover")
    return {**{k: v for k, v in record.items() if k not in per_call_only}, **pipelined}


def load_fit(backend: str, world_size: int,
             paths: Iterable[str | Path] = (RUNS_FIT, REFERENCE_FIT),
             pipelined: bool = False) -> tuple[AlphaBeta, dict]:
    """The first saved fit for (backend, world_size) among `paths`: (model, record with rows, machine and path).

    `pipelined=True`: for predictions of calls issued back to back (lessons 04, 05), the fit of the pipelined
    measurement where the record has one, else the per-call fit; the record's `alpha_method` says which
    ("pipelined", "per call", or "per call (no pipelined fit saved)")."""
    tried = []
    for path in map(Path, paths):
        tried.append(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path))
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        for rec in data["fits"]:
            if rec["backend"] == backend and rec["world_size"] == world_size:
                model = AlphaBeta(rec["alpha_s"], rec["beta_s_per_byte"], rec.get("alpha_resolved", True))
                method = "per call"
                if pipelined and "pipelined" in rec:
                    p = rec["pipelined"]
                    model = AlphaBeta(p["alpha_s"], p["beta_s_per_byte"], p.get("alpha_resolved", True))
                    method = "pipelined"
                    rec = as_pipelined(rec, p)
                elif pipelined:
                    method = "per call (no pipelined fit saved)"
                return model, {**rec, "machine": rec.get("machine", data.get("machine", "")), "path": tried[-1],
                               "alpha_method": method}
    raise FileNotFoundError(f"no α–β fit for {backend} x{world_size} in {', '.join(tried)}: run lesson 01 "
                            f"or `python -m ddp_lib.bench allreduce --min-size 4K --fit-json runs/alphabeta_fit.json`")
