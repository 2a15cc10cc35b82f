"""The course's diagrams, drawn with matplotlib: `python -m ddp_lib.course.diagrams` regenerates them under assets/.

- assets/ddp_overview.png: ranks, each with a model replica and its shard of the batch; the
  gradients are all-reduced so that every replica takes the same optimizer step.
- assets/bucketed_overlap.png: a schematic timeline of backward, with each bucket's all-reduce
  running on the communication stream while backward goes on, against the blocking alternative.
- assets/zero_memory.png: lesson 07's model states per rank for the XXL FFN model under ZeRO
  stages 0-3 (drawn by `ddp_lib.kit.memory.plot_zero_memory`; the lesson itself writes to runs/).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ASSETS = Path(__file__).resolve().parents[2] / "assets"

BLUE, ORANGE, GREEN, GREY, RED = "#4C72B0", "#DD8452", "#55A868", "#8C8C8C", "#C44E52"


def _box(ax, x: float, y: float, w: float, h: float, text: str, color: str, fontsize: float = 9,
         text_color: str = "white") -> None:
    """A rounded, filled box with centred text."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=color, edgecolor="none"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], color: str = GREY, style: str = "-|>",
           lw: float = 1.4, rad: float = 0.0) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=11, color=color, lw=lw,
                                 connectionstyle=f"arc3,rad={rad}"))


def ddp_overview(path: Path) -> Path:
    """Ranks with a replica and a data shard each; all-reduce of the gradients; identical optimizer steps."""
    fig, ax = plt.subplots(figsize=(7.2, 3.6), dpi=100)
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 5.2)
    ax.axis("off")
    # the global batch, split by rank
    _box(ax, 2.0, 4.45, 6.0, 0.55, "global batch  →  shard_batch(batch, rank, world_size)", GREY, 9)
    for i, x in enumerate((0.6, 5.6)):
        ax.text(x + 0.05, 4.15, f"rank {i}", ha="left", va="center", fontsize=10, fontweight="bold")
        _box(ax, x, 3.35, 3.8, 0.6, f"data shard {i}: half of the batch", ORANGE, 9)
        _box(ax, x, 2.45, 3.8, 0.65, "model replica (same seed, same weights)\nforward → loss → backward", BLUE, 8.5)
        _box(ax, x, 1.65, 3.8, 0.55, f"local gradients g{i}", GREEN, 9)
        _box(ax, x, 0.2, 3.8, 0.55, "optimizer.step(): identical update", BLUE, 9)
        _arrow(ax, (x + 1.9, 4.45), (x + 1.9, 3.95))
        _arrow(ax, (x + 1.9, 3.35), (x + 1.9, 3.1))
        _arrow(ax, (x + 1.9, 2.45), (x + 1.9, 2.2))
    # the all-reduce between the two gradient boxes, and its result flowing down to both optimizers
    _box(ax, 3.0, 0.93, 4.0, 0.5, "all-reduce:  g = (g0 + g1) / world_size", RED, 9)
    _arrow(ax, (2.5, 1.65), (3.6, 1.43), RED, rad=0.15)
    _arrow(ax, (7.5, 1.65), (6.4, 1.43), RED, rad=-0.15)
    _arrow(ax, (3.6, 0.93), (2.5, 0.75), RED, rad=0.15)
    _arrow(ax, (6.4, 0.93), (7.5, 0.75), RED, rad=-0.15)
    fig.tight_layout(pad=0.2)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def bucketed_overlap(path: Path) -> Path:
    """Timeline: backward then blocking all-reduces, against bucket all-reduces that overlap backward."""
    layers = 6  # backward runs from the last layer to the first
    t_bwd, t_comm = 1.0, 0.8  # per layer / per bucket (two layers per bucket), arbitrary units
    fig, ax = plt.subplots(figsize=(7.2, 2.9), dpi=100)
    rows = {"blocking: compute": 3.2, "blocking: comm": 2.6, "bucketed: compute": 1.3, "bucketed: comm": 0.7}
    h = 0.45
    # blocking: all of backward, then one all-reduce per bucket
    for i in range(layers):
        ax.broken_barh([(i * t_bwd, t_bwd * 0.96)], (rows["blocking: compute"], h), color=BLUE)
        ax.text(i * t_bwd + 0.48, rows["blocking: compute"] + h / 2, f"L{layers - i}", ha="center", va="center",
                color="white", fontsize=8)
    end_bwd = layers * t_bwd
    for b in range(layers // 2):
        start = end_bwd + b * t_comm
        ax.broken_barh([(start, t_comm * 0.96)], (rows["blocking: comm"], h), color=RED)
        ax.text(start + t_comm / 2, rows["blocking: comm"] + h / 2, f"b{b}", ha="center", va="center",
                color="white", fontsize=8)
    blocking_end = end_bwd + (layers // 2) * t_comm
    # bucketed: a bucket's all-reduce starts as soon as its last gradient is ready
    comm_free = 0.0
    for i in range(layers):
        ax.broken_barh([(i * t_bwd, t_bwd * 0.96)], (rows["bucketed: compute"], h), color=BLUE)
        ax.text(i * t_bwd + 0.48, rows["bucketed: compute"] + h / 2, f"L{layers - i}", ha="center", va="center",
                color="white", fontsize=8)
        if i % 2 == 1:
            ready = (i + 1) * t_bwd
            start = max(ready, comm_free)
            ax.broken_barh([(start, t_comm * 0.96)], (rows["bucketed: comm"], h), color=RED)
            ax.text(start + t_comm / 2, rows["bucketed: comm"] + h / 2, f"b{i // 2}", ha="center", va="center",
                    color="white", fontsize=8)
            comm_free = start + t_comm
    for x, y in ((blocking_end, rows["blocking: comm"]), (comm_free, rows["bucketed: comm"])):
        ax.axvline(x, ymin=0, ymax=1, color=GREY, lw=0.8, ls=":")
    ax.annotate("", xy=(comm_free, 0.35), xytext=(blocking_end, 0.35),
                arrowprops=dict(arrowstyle="<->", color=GREEN, lw=1.4))
    ax.text((comm_free + blocking_end) / 2, 0.12, "time saved", ha="center", va="center", color=GREEN, fontsize=8)
    ax.set_yticks([y + h / 2 for y in rows.values()], list(rows))
    ax.set_xlabel("time →   (L6…L1: backward of each layer, last layer first;  b0…b2: bucket all-reduces)",
                  fontsize=8)
    ax.set_xticks([])
    ax.set_xlim(0, blocking_end + 0.3)
    ax.set_ylim(0, 3.8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title("Backward with blocking all-reduces vs bucket all-reduces overlapping backward", fontsize=9)
    fig.tight_layout(pad=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """Regenerate every diagram under assets/ and print what was written."""
    ASSETS.mkdir(exist_ok=True)
    from ddp_lib.kit.memory import plot_zero_memory

    for make, name in ((ddp_overview, "ddp_overview.png"), (bucketed_overlap, "bucketed_overlap.png"),
                       (plot_zero_memory, "zero_memory.png")):
        out = make(ASSETS / name)
        print(f"wrote assets/{out.name} ({out.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
