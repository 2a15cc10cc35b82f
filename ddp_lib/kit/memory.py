"""Lesson 07's memory calculator: model states, activations, ZeRO stages and FSDP per device.

Bytes per parameter are given as (weights, gradients, optimizer state):

- `WRITE_UP` = (4, 4, 8): the accounting of Stanford CS336's Assignment 2 handout (Spring 2025, problem
  `communication_accounting`, which defines the XXL FFN model): fp32 master weights, fp32 accumulated
  gradients and fp32 optimizer state, i.e. Adam's two moments; activations in bf16.
  https://github.com/stanford-cs336/assignment2-systems/blob/main/cs336_spring2025_assignment2_systems.pdf
- `ZERO_PAPER` = (2, 2, 12): the ZeRO paper's mixed precision (Rajbhandari et al. 2020, arXiv:1910.02054,
  section 3.1), fp16/bf16 weights and gradients, and K = 12 bytes of optimizer state (fp32 master weights + the
  two moments).

The numbers lesson 07 prints for these accountings are computed here; the handout poses the questions only.

`python -m ddp_lib.course.diagrams` redraws the README figure assets/zero_memory.png with `plot_zero_memory`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9
H100_BYTES = 80 * GB  # "an H100 80GB" counted as 80 * 10**9 bytes
WRITE_UP = (4, 4, 8)
ZERO_PAPER = (2, 2, 12)


@dataclass(frozen=True)
class FFNModel:
    """A stack of `blocks` feed-forward blocks, each an up (d_model x d_ff) and a down (d_ff x d_model) linear."""

    d_model: int = 16384  # defaults: the CS336 handout's XXL configuration
    d_ff: int = 53248
    blocks: int = 126

    @property
    def params(self) -> int:
        """Weights of all linears (biases, 0.004 % more for the XXL model, are left out)."""
        return self.blocks * 2 * self.d_model * self.d_ff


XXL = FFNModel()


def model_state_bytes(psi: int, split: tuple[int, int, int] = WRITE_UP) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state for `psi` parameters, unsharded."""
    w, g, o = split
    return {"weights": w * psi, "gradients": g * psi, "optimizer": o * psi}


def activation_bytes(model: FFNModel, batch: int, seq: int, bytes_per_value: int = 2) -> float:
    """num_blocks * batch * seq * (d_model + d_ff) * 2 bytes: each block's input and hidden kept for backward, bf16."""
    return model.blocks * batch * seq * (model.d_model + model.d_ff) * bytes_per_value


def gpus_needed(total_bytes: float, gpu_bytes: float = H100_BYTES) -> int:
    """How many GPUs of `gpu_bytes` hold `total_bytes` if it could be split perfectly."""
    return math.ceil(total_bytes / gpu_bytes)


def zero_per_rank(psi: int, world_size: int, stage: int, split: tuple[int, int, int] = ZERO_PAPER) -> float:
    """Model-state bytes per rank under ZeRO stage 0 (DDP), 1 (optimizer), 2 (+ gradients), 3 (+ weights)."""
    w, g, o = (b * psi for b in split)
    return (w / world_size if stage >= 3 else w) + (g / world_size if stage >= 2 else g) + (
        o / world_size if stage >= 1 else o)


def fsdp_per_device(psi: int, devices: int, act: float, split: tuple[int, int, int] = WRITE_UP) -> float:
    """sum(split) * N / G + A / 2 + A / (2 G): every model state sharded, half of the activations sharded."""
    return sum(split) * psi / devices + act / 2 + act / (2 * devices)


def fsdp_devices_needed(psi: int, act: float, split: tuple[int, int, int] = WRITE_UP,
                        gpu_bytes: float = H100_BYTES) -> int | None:
    """Smallest G with fsdp_per_device <= gpu_bytes; None when the unsharded half of the activations alone is too big."""
    room = gpu_bytes - act / 2  # what each device has left for its share of the sharded part
    if room <= 0:
        return None
    return math.ceil((sum(split) * psi + act / 2) / room)


def zero_memory_figure(model: FFNModel = XXL, split: tuple[int, int, int] = ZERO_PAPER, max_exp: int = 10,
                       gpu_bytes: float = H100_BYTES):
    """A pyplot figure: model states per rank against data-parallel ranks (1 to 2**max_exp), ZeRO stages 0-3."""
    import matplotlib.pyplot as plt

    ns = [2 ** e for e in range(max_exp + 1)]
    fig, ax = plt.subplots(figsize=(5.6, 3.2))
    for stage, marker in zip(range(4), "osD^"):
        ax.loglog(ns, [zero_per_rank(model.params, n, stage, split) / GB for n in ns], marker=marker, ms=4,
                  label=f"ZeRO-{stage}")
    ax.axhline(gpu_bytes / GB, color="black", lw=0.8, ls="--")
    ax.text(1.1, gpu_bytes / GB * 1.2, f"{gpu_bytes / GB:.0f} GB (one H100)", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("data-parallel ranks (GPUs)")
    ax.set_ylabel("model states per rank (GB)")
    ax.set_title(f"XXL FFN model ({model.params / 1e9:.0f} B parameters), "
                 f"{' + '.join(map(str, split))} = {sum(split)} B/parameter", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def plot_zero_memory(path: Path) -> Path:
    """Draw `zero_memory_figure()` (the README's assets/zero_memory.png) into `path`."""
    import matplotlib.pyplot as plt

    fig = zero_memory_figure()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def reachable_tensors(obj: Any, skip: set[int], depth: int = 8) -> list[torch.Tensor]:
    """Every tensor reachable from `obj` through attributes, dicts, lists and tuples (not ids in `skip`): what an
    optimizer or a wrapper really holds, measured by the ZeRO and FSDP checkers and the FSDP comparison."""
    import torch

    found, seen, todo = [], set(), [(obj, 0)]
    while todo:
        o, d = todo.pop()
        if id(o) in seen or d > depth or isinstance(o, (str, bytes, int, float, bool, type(None), type)):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            if id(o) not in skip and o.data_ptr() not in skip:
                found.append(o)
            continue
        if isinstance(o, dict):
            items = list(o.keys()) + list(o.values())
        elif isinstance(o, (list, tuple, set, frozenset)):
            items = list(o)
        elif hasattr(o, "__dict__") and not callable(o):
            items = list(vars(o).values())
        else:
            continue
        todo.extend((i, d + 1) for i in items)
    return found
