"""Figures and files of the benchmarks: all-reduce time/busbw vs size, the DDP race as bars, JSON + CSV rows."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; notebooks display the returned figure themselves
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter, ScalarFormatter  # noqa: E402

from ddp_lib.bench.allreduce import machine_label  # noqa: E402
from ddp_lib.bench.alphabeta import fit_by_group  # noqa: E402
from ddp_lib.bench.race import overlap_columns  # noqa: E402

MB = 2**20


def save_rows(rows: list[dict], json_path: str | Path) -> tuple[Path, Path]:
    """Write rows as a JSON list and as a CSV with the same stem (columns: the union of keys, first-seen order)."""
    json_path = Path(json_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    json_path.write_text(json.dumps(clean, indent=1) + "\n")
    cols = list(dict.fromkeys(k for r in clean for k in r))
    csv_path = json_path.with_suffix(".csv")
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(clean)
    return json_path, csv_path


def plot_allreduce(rows: list[dict], path: str | Path | None = None, title: str = ""):
    """Time (median, IQR bars) with the α–β fit, measured/model, and busbw vs size, per (backend, ranks)."""
    fits = fit_by_group(rows)
    fig, (ax_t, ax_r, ax_b) = plt.subplots(1, 3, figsize=(14, 4))
    for (backend, ws) in sorted({(r["backend"], r["world_size"]) for r in rows}):
        rs = sorted((r for r in rows if (r["backend"], r["world_size"]) == (backend, ws)), key=lambda r: r["size_bytes"])
        x = [r["size_bytes"] / MB for r in rs]
        t = [r["time_us"] / 1e3 for r in rs]
        err = _iqr_err(rs, "time_us", 1e-3)
        bars = ax_t.errorbar(x, t, yerr=err, fmt="o-", capsize=3, label=f"{backend}, {ws} ranks (median, IQR)")
        color = bars.lines[0].get_color()
        if (backend, ws) in fits:
            fit = fits[(backend, ws)]
            model = [fit.time_s(r["size_bytes"]) * 1e3 for r in rs]
            ax_t.plot(x, model, "--", color=color,
                      label=f"α={fit.alpha_us:.0f} µs, 1/β={fit.bandwidth_GBps:.2f} GB/s")
            # a noisy fit over a few small sizes can have β < 0, so the line goes negative at the large end:
            # measured/model is plotted only where the model predicts a positive time
            keep = [i for i, m in enumerate(model) if m > 0]
            ratio_err = [[side[i] / model[i] for i in keep] for side in err] if err is not None else None
            ax_r.errorbar([x[i] for i in keep], [t[i] / model[i] for i in keep], yerr=ratio_err, fmt="o-",
                          capsize=3, color=color, label=f"{backend}, {ws} ranks")
        busbw = [r["busbw_GBps"] for r in rs]
        ax_b.plot(x, busbw, "o-", color=color, label=f"{backend}, {ws} ranks")
    ax_r.axhline(1.0, color="k", lw=0.8)
    for ax, ylabel in ((ax_t, "time per all-reduce (ms)"), (ax_r, "measured / α–β model"), (ax_b, "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (MiB, float32)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_r.set_yscale("log")
    ax_r.yaxis.set_major_formatter(ScalarFormatter())  # 0.5, 1, 2 rather than 5x10^-1
    ax_r.yaxis.set_minor_formatter(NullFormatter())
    ax_t.set_title("all-reduce time (slowest rank per call)")
    ax_r.set_title("residuals of the fit (1 = exact)")
    ax_b.set_title("bus bandwidth = size/time · 2(n-1)/n")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    return fig


def _iqr_err(rows: list[dict], key: str, scale: float) -> list[list[float]] | None:
    """Asymmetric error bars (median - p25, p75 - median) from `p25_<key>`/`p75_<key>`, if the rows have them."""
    if not all(f"p25_{key}" in r and f"p75_{key}" in r for r in rows):
        return None
    return [[(r[key] - r[f"p25_{key}"]) * scale for r in rows], [(r[f"p75_{key}"] - r[key]) * scale for r in rows]]


def plot_ddp(rows: list[dict], path: str | Path | None = None, shares: dict[str, float | None] | None = None):
    """Bars per variant: compute (the nocomm step), exposed and hidden communication; the sweep vs α–β if present."""
    sweep = [r for r in rows if r["variant"].startswith("bucketed") and r.get("predicted_exposed_ms") is not None]
    sweep = sorted(sweep, key=lambda r: r["bucket_mb"]) if len({r["bucket_mb"] for r in sweep}) > 1 else []
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 7, 4.2), squeeze=False)
    ax = axes[0][0]
    base = next((r["step_ms"] for r in rows if r["variant"] == "nocomm"), 0.0)
    names = [r["variant"] for r in rows]
    compute = [min(base, r["step_ms"]) for r in rows]
    exposed = [r["step_ms"] - c for r, c in zip(rows, compute)]
    hidden = [r["hidden_ms"] or 0.0 for r in overlap_columns(rows, shares)]
    ax.bar(names, compute, color="#9ab", label="compute (nocomm step)")
    ax.bar(names, exposed, bottom=compute, color="#d62", label="exposed comm (step - nocomm)")
    ax.bar(names, hidden, bottom=[c + e for c, e in zip(compute, exposed)], color="none", edgecolor="#2a6",
           hatch="//", label="hidden comm (share reduced by the end of backward x total)")
    for i, r in enumerate(rows):
        ax.text(i, r["step_ms"], f"{r['step_ms']:.1f}\n{r['comm_calls']} calls", ha="center", va="bottom", fontsize=7)
    # headroom above the tallest bar for its label and the legend
    ax.set_ylim(top=1.5 * max(max(r["step_ms"] for r in rows), max(c + e + h for c, e, h in zip(compute, exposed, hidden))))
    r0 = rows[0]
    ax.set_title(f"DDP step, {r0['model']}, {r0['world_size']}x {r0['backend']} on {machine_label()}\n"
                 "(median over steps of the slowest rank)", fontsize=10)
    ax.set_ylabel("ms per step")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8, loc="upper left")
    if sweep:
        ax = axes[0][1]
        x = [r["bucket_mb"] for r in sweep]
        # BucketedDDP waits inside backward (end-of-backward callback), so what it did not hide shows in the step
        err = None
        if all("p25_step_ms" in r for r in sweep):  # the step's IQR, carried over to step - nocomm
            err = [[r["step_ms"] - r["p25_step_ms"] for r in sweep], [r["p75_step_ms"] - r["step_ms"] for r in sweep]]
        ax.errorbar(x, [r["exposed_comm_ms"] for r in sweep], yerr=err, fmt="o-", capsize=3,
                    label="measured: step - nocomm step (median, IQR)")
        ax.plot(x, [r["predicted_exposed_ms"] for r in sweep], "s--", label="α–β model E(b)")
        best = sweep[0]["predicted_best_bucket_mb"]
        ax.axvline(best, color="gray", ls=":", label=f"model's best whole number of buckets: {best:.3g} MiB")
        ax.set_xscale("log")
        ax.set_xlabel("bucket cap (MiB)")
        ax.set_ylabel("ms (median of the slowest rank)")
        ax.set_title("bucket-size sweep")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def plot_timelines(lines: list[dict], xlabel: str, title: str = ""):
    """One panel per engine (`timeline.step_timeline` dicts): forward and backward's compute, and each all-reduce
    from its launch (tick) or the previous one's completion, whichever is later, to its own completion."""
    fig, axes = plt.subplots(len(lines), 1, figsize=(8, 1.1 + 1.05 * len(lines)), sharex=True, squeeze=False)
    for ax, ln in zip(axes[:, 0], lines):
        ax.barh("compute", ln["fwd"], color="0.75", label="forward")
        ax.barh("compute", ln["bwd"] - ln["fwd"], left=ln["fwd"], color="0.45", label="backward")
        prev_done = 0.0
        for i, (_, a, b) in enumerate(ln["comm"]):
            start = min(max(a, prev_done), b)  # one queue: a collective runs once the previous one is done
            ax.barh("all-reduce", b - start, left=start, color=f"C{i % 2}", alpha=0.85, edgecolor="k", linewidth=0.3)
            ax.plot([a, a], [0.62, 0.78], color="k", lw=0.8)  # launch tick
            prev_done = max(prev_done, b)
        ax.axvline(ln["bwd"], color="k", ls=":", lw=1)
        ax.axvline(ln["end"], color="C3", lw=1.5)
        ax.set_title(f"{ln['engine']}: {ln['calls']} all-reduces, {ln['end'] - ln['bwd']:.1f} ms after backward's "
                     "compute (red: gradients averaged)", fontsize=9, loc="left")
    axes[0, 0].legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel(xlabel)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
