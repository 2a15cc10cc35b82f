"""Figures and files of the benchmarks: all-reduce time/busbw vs size, the DDP race as bars, JSON + CSV rows."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; notebooks display the returned figure themselves
import matplotlib.pyplot as plt  # noqa: E402

from ddp_lib.bench.alphabeta import fit_by_group  # noqa: E402

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


def plot_allreduce(rows: list[dict], path: str | Path | None = None):
    """Time and busbw vs size, one line per (backend, world size), with the α–β fit dashed; saved if `path`."""
    fits = fit_by_group(rows)
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    for (backend, ws) in sorted({(r["backend"], r["world_size"]) for r in rows}):
        rs = sorted((r for r in rows if (r["backend"], r["world_size"]) == (backend, ws)), key=lambda r: r["size_bytes"])
        x = [r["size_bytes"] / MB for r in rs]
        line, = ax_t.plot(x, [r["time_us"] / 1e3 for r in rs], "o-", label=f"{backend}, {ws} ranks")
        if (backend, ws) in fits:
            fit = fits[(backend, ws)]
            ax_t.plot(x, [fit.time_s(r["size_bytes"]) * 1e3 for r in rs], "--", color=line.get_color(),
                      label=f"α={fit.alpha_us:.0f} µs, 1/β={fit.bandwidth_GBps:.2f} GB/s")
        ax_b.plot(x, [r["busbw_GBps"] for r in rs], "o-", color=line.get_color(), label=f"{backend}, {ws} ranks")
    for ax, ylabel in ((ax_t, "time per all-reduce (ms)"), (ax_b, "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (MiB, float32)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.set_title("all-reduce time (median of slowest rank)")
    ax_b.set_title("bus bandwidth = size/time · 2(n-1)/n")
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def plot_ddp(rows: list[dict], path: str | Path | None = None):
    """Bars per variant: compute (the nocomm step), exposed and hidden communication; the sweep vs α–β if present."""
    sweep = [r for r in rows if r["variant"].startswith("bucketed") and r.get("predicted_exposed_ms") is not None]
    sweep = sorted(sweep, key=lambda r: r["bucket_mb"]) if len({r["bucket_mb"] for r in sweep}) > 1 else []
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 7, 4.2), squeeze=False)
    ax = axes[0][0]
    base = next((r["step_ms"] for r in rows if r["variant"] == "nocomm"), 0.0)
    names = [r["variant"] for r in rows]
    compute = [min(base, r["step_ms"]) for r in rows]
    exposed = [r["step_ms"] - c for r, c in zip(rows, compute)]
    hidden = [r.get("hidden_comm_ms") or 0.0 for r in rows]
    ax.bar(names, compute, color="#9ab", label="compute (nocomm step)")
    ax.bar(names, exposed, bottom=compute, color="#d62", label="exposed comm (step - nocomm)")
    ax.bar(names, hidden, bottom=[c + e for c, e in zip(compute, exposed)], color="none", edgecolor="#2a6",
           hatch="//", label="hidden comm (total - exposed)")
    for i, r in enumerate(rows):
        ax.text(i, r["step_ms"], f"{r['step_ms']:.1f}\n{r['comm_calls']} calls", ha="center", va="bottom", fontsize=7)
    ax.set_ylim(top=1.15 * max(max(r["step_ms"] for r in rows), max(c + e + h for c, e, h in zip(compute, exposed, hidden))))
    r0 = rows[0]
    ax.set_title(f"DDP step, {r0['model']}, {r0['world_size']}x {r0['backend']} (median of slowest rank)")
    ax.set_ylabel("ms per step")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize=8)
    if sweep:
        ax = axes[0][1]
        x = [r["bucket_mb"] for r in sweep]
        ax.plot(x, [r["exposed_comm_ms"] for r in sweep], "o-", label="measured exposed comm")
        ax.plot(x, [r["predicted_exposed_ms"] for r in sweep], "s--", label="α–β model")
        best = sweep[0]["predicted_best_bucket_mb"]
        ax.axvline(best, color="gray", ls=":", label=f"predicted best {best:.3g} MB")
        ax.set_xscale("log")
        ax.set_xlabel("bucket size (MB)")
        ax.set_ylabel("exposed comm (ms)")
        ax.set_title("bucket-size sweep")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig
