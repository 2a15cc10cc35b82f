"""The race's table: what each DDP variant cost, how much of its communication it overlapped, and at what price.

Definitions (milliseconds; every quantity is the slowest rank's, median over timed steps):
  total    the variant's own all-reduces issued back to back with nothing else running (`total_comm_ms`):
           what its communication costs when nothing hides it
  finish   the time spent inside finish_gradient_synchronization() after backward returned (`finish_ms`). Naive
           and flat communicate there: all of their communication plus any wait for a slower rank. Overlap and
           bucketed already launched what was pending and waited for every all-reduce at the end of backward
           (an autograd callback, as torch DDP's reducer does): their finish only confirms, ~0
  hidden   the share of the gradient bytes already reduced when the engine's synchronization started (at the
           end of backward's compute for overlap/bucketed, before their end-of-backward wait; in finish for
           naive/flat), measured directly by `overlap_probe` (asynchronous all-reduces asked whether they
           completed). Engines that start communicating only after backward (naive, flat) hide nothing by
           construction; the measure depends neither on how much slower backward got nor on waiting for a slower rank.
  bwd+     backward - backward of `nocomm`. For naive and flat (nothing runs during backward) it is noise around 0.
           For overlap and bucketed it is what backward lost while communication ran beside it (on a CPU the
           collective's threads take cores from the math; on a GPU its kernels take SMs and memory bandwidth) plus
           their end-of-backward wait for the communication not yet done (and for a slower rank); `exposed` is
           the step-level total. Overlap pays when it hides more than backward lost.
  tok/s    tokens trained on per second over all ranks, at the median step (smp/s, samples, where the workload has
           no tokens); MFU their model FLOPs per second over the ranks' datasheet peak ('-' without one, the reason
           below the table): `throughput.throughput_columns`
torch DDP's reducer also waits for its last bucket inside backward, but it is not visible to the probe and has no
finish call, so `finish`, `hidden` and `bwd+` are '-' there; compare its step time and `exposed` instead.
The α–β model's E(b) (`alphabeta.exposed_comm_s`) predicts the communication left when backward's compute ends,
assuming backward is not slowed: compare it with `exposed` (= step - nocomm step), not with `finish`.
"""

from __future__ import annotations

import math
import random
import statistics

from ddp_lib.bench.alphabeta import AlphaBeta, best_bucket_bytes, exposed_comm_s
from ddp_lib.bench.throughput import rate_column, throughput_columns

MB = 2**20


def overlap_columns(rows: list[dict], shares: dict[str, float | None] | None = None) -> list[dict]:
    """Copies of the rows with `hidden_share` (from `shares`, the probe's result), `hidden_ms` (that share of
    `total`) and `bwd_extra_ms`; None where not measured."""
    base = next(r for r in rows if r["variant"] == "nocomm")
    out = []
    for r in rows:
        share = (shares or {}).get(r["variant"]) if r is not base else None
        total = r.get("total_comm_ms") or 0.0
        out.append({**r, "hidden_share": share, "hidden_ms": share * total if share is not None else None,
                    "bwd_extra_ms": r["bwd_ms"] - base["bwd_ms"] if r.get("finish_ms") is not None and r is not base
                    else None})
    return out


def overlap_bound(rows: list[dict]) -> dict | None:
    """The step that perfect overlap could reach: nocomm's step with its backward replaced by max(backward, the
    cheapest communication measured: the smallest `total_comm_ms` over the variants, flat's one call as a rule),
    i.e. forward + optimizer + max(backward, communication). Returns {bound_ms, backward_ms, comm_ms, rest_ms,
    ratios: {variant: step / bound}}, or None without a nocomm row or a measured communication."""
    base = next((r for r in rows if r["variant"] == "nocomm"), None)
    comms = [r["total_comm_ms"] for r in rows if r is not base and r.get("total_comm_ms")]
    if base is None or not comms:
        return None
    comm, backward = min(comms), base["bwd_ms"]
    rest = base["step_ms"] - backward
    bound = rest + max(backward, comm)
    return dict(bound_ms=bound, backward_ms=backward, comm_ms=comm, rest_ms=rest,
                ratios={r["variant"]: r["step_ms"] / bound for r in rows if r is not base})


def format_bound(rows: list[dict]) -> str:
    """One line: the perfect-overlap bound, what it is made of, and each variant's step over it."""
    b = overlap_bound(rows)
    if b is None:
        return "perfect-overlap bound: not measured (needs nocomm and a variant's total communication)"
    ratios = ", ".join(f"{v} {x:.2f}" for v, x in b["ratios"].items())
    return (f"perfect-overlap bound {b['bound_ms']:.1f} ms = forward+optimizer {b['rest_ms']:.1f} + max(backward "
            f"{b['backward_ms']:.1f}, cheapest communication {b['comm_ms']:.1f}); step / bound: {ratios}")


def format_race(rows: list[dict], shares: dict[str, float | None] | None = None) -> str:
    """The race as a table: step (median and spread), the overlap columns above, calls, peak memory, tokens (or
    samples) per second and MFU, parameter check; then why MFU is '-', once, where it is."""
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    def step_spread(r: dict) -> str:
        if "p25_step_ms" in r and "p75_step_ms" in r:
            return f"{r['p25_step_ms']:.1f}-{r['p75_step_ms']:.1f}"
        if "max_step_ms" in r:
            return f"{r['min_step_ms']:.1f}-{r['max_step_ms']:.1f}"
        return f"{r['min_step_ms']:.1f}"

    rows = throughput_columns(overlap_columns(rows, shares))
    spread_name = ("IQR" if "p25_step_ms" in rows[0] else "min-max" if "max_step_ms" in rows[0] else "fastest")
    rate_name, rate_key = rate_column(rows)
    head = (f"{'variant':<14} {'step':>7} {spread_name:>13} {'exposed':>8} {'finish':>7} {'total':>7} {'hidden':>7} "
            f"{'bwd+':>6} {'calls':>5} {'peak_MB':>7} {rate_name:>9} {'MFU':>6} {'param_diff':>10}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['variant']:<14} {f(r['step_ms']):>7} {step_spread(r):>13} {f(r['exposed_comm_ms']):>8} "
                     f"{f(r['finish_ms']):>7} {f(r['total_comm_ms'] or None):>7} {f(r['hidden_share'], '.0%'):>7} "
                     f"{f(r['bwd_extra_ms']):>6} {r['comm_calls']:>5} {f(r.get('peak_mem_mb'), '.0f'):>7} "
                     f"{f(r[rate_key], ',.0f'):>9} {f(r['mfu'], '.1%'):>6} {f(r.get('param_diff'), '.1e'):>10}")
    what = next((r["peak_what"] for r in rows if r.get("peak_what")), None)  # one peak for every variant
    if what is not None and all(r["mfu"] is not None for r in rows):
        what = f"MFU against each rank's {what}"
    return "\n".join(lines + ([what] if what else []))


def format_race_short(rows: list[dict], shares: dict[str, float | None] | None = None) -> str:
    """The race as lesson 05 teaches it: step (median, IQR), exposed, hidden, calls, and whether the final
    parameters equal the reference variant's (1e-5); `format_race` has every column."""
    def f(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    lines = [f"{'variant':<14} {'step ms':>8} {'IQR':>13} {'exposed':>8} {'hidden':>7} {'calls':>5} {'equal':>6}"]
    for r in overlap_columns(rows, shares):
        same = "-" if r.get("param_diff") is None else ("yes" if r["param_diff"] <= 1e-5 else "NO")
        lines.append(f"{r['variant']:<14} {f(r['step_ms']):>8} {r['p25_step_ms']:>6.1f}-{r['p75_step_ms']:<6.1f} "
                     f"{f(r['exposed_comm_ms']):>8} {f(r['hidden_share'], '.0%'):>7} {r['comm_calls']:>5} {same:>6}")
    return "\n".join(lines + [format_bound(rows)])


def round_ratios(rows: list[dict], a: str = "bucketed", b: str = "torch-view") -> list[float] | None:
    """`a`'s step over `b`'s round by round (each round's median step, `round_step_ms`): pairs steps of the same
    round, so a machine whose speed drifts from round to round does not decide; None without both."""
    by = {r["variant"]: r.get("round_step_ms") or [] for r in rows}
    if not by.get(a) or len(by[a]) != len(by.get(b) or []):
        return None
    return [x / y for x, y in zip(by[a], by[b])]


def median_interval(xs: list[float], level: float = 0.9, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The central `level` share of the medians of `n_boot` resamples of `xs` (drawn with replacement, as many as
    `xs`): a percentile bootstrap of the median, deterministic for a seed; equal values give a zero-width interval."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n_boot))
    k = round((1 - level) / 2 * n_boot)
    return medians[k], medians[n_boot - 1 - k]


def format_round_ratios(rows: list[dict], a: str = "bucketed", b: str = "torch-view") -> str | None:
    """One line: `a` / `b` per round, their median (from 5 rounds on, with its 90% bootstrap interval: whether the
    median is resolved from 1.00 on this machine), and how many rounds were at or below 1.00 (None under 2 rounds)."""
    ratios = round_ratios(rows, a, b)
    if ratios is None or len(ratios) < 2:
        return None
    below = sum(x <= 1.0 for x in ratios)
    interval = ""
    if len(ratios) >= 5:
        lo, hi = median_interval(ratios)
        interval = f" (90% bootstrap interval {lo:.3f}-{hi:.3f})"
    return (f"{a} / {b} round by round (each round's median step): {' '.join(f'{x:.3f}' for x in ratios)}; "
            f"median {statistics.median(ratios):.3f}{interval}, {below} of {len(ratios)} rounds at or below 1.00")


def headline(rows: list[dict], shares: dict[str, float | None] | None = None) -> dict:
    """Per variant the figures a README may quote (step_ms, p25/p75, exposed_ms, hidden_share, calls), plus
    the ratios the lesson's targets are about: bucketed/naive and bucketed/torch-view median steps, and the latter
    round by round (`bucketed_over_torch_view_rounds`: one ratio per round, a single one after one round)."""
    out = {r["variant"]: dict(step_ms=r["step_ms"], p25_step_ms=r["p25_step_ms"], p75_step_ms=r["p75_step_ms"],
                              exposed_ms=r["exposed_comm_ms"], hidden_share=r["hidden_share"], calls=r["comm_calls"])
           for r in overlap_columns(rows, shares)}
    bound = overlap_bound(rows)
    if bound is not None:
        out["overlap_bound_ms"] = bound["bound_ms"]
        out["step_over_bound"] = bound["ratios"]
    step = {v: d["step_ms"] for v, d in out.items() if isinstance(d, dict) and "step_ms" in d}
    if "bucketed" in step:
        for other in ("naive", "torch-view", "torch"):
            if other in step:
                out[f"bucketed_over_{other.replace('-', '_')}"] = step["bucketed"] / step[other]
    rounds = round_ratios(rows)
    if rounds is not None:
        out["bucketed_over_torch_view_rounds"] = rounds
    return out


def add_predictions(rows: list[dict], model: AlphaBeta, min_bucket_bytes: float = 4096) -> dict:
    """Add the α–β model's exposed communication E(b) to every bucketed row, at its measured number of buckets.

    Backward B is the `nocomm` row's backward, N the gradient bytes; `min_bucket_bytes` is the smallest bucket the
    engine can make (a bucket never splits a tensor: pass the largest gradient's size). Returns the model's view:
    alpha_us, bandwidth_GBps, the best bucket size (MB) and the closed-form N·sqrt(α/B) (MB).
    """
    base = next(r for r in rows if r["variant"] == "nocomm")
    total, backward = base["grad_mb"] * MB, base["bwd_ms"] / 1e3
    best = best_bucket_bytes(model, total, backward, min_bytes=min_bucket_bytes)
    view = dict(alpha_us=model.alpha_us, bandwidth_GBps=model.bandwidth_GBps, predicted_best_bucket_mb=best / MB,
                closed_form_bucket_mb=total * math.sqrt(model.alpha_s / backward) / MB)
    for r in rows:
        r.update(view)
        if r["variant"].startswith("bucketed") and r["comm_calls"]:
            # real buckets follow tensor boundaries: evaluate the model at the bucket count the engine made
            r["predicted_exposed_ms"] = exposed_comm_s(total / r["comm_calls"], model, total, backward) * 1e3
    return view
