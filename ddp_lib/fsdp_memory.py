"""Lesson 08: per-device memory of FSDP training, and how many devices a model needs (the XXL FFN model)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class FFNModel:
    """A stack of `num_blocks` feed-forward blocks, each two linears: d_model -> d_ff -> d_model (weights only)."""

    d_model: int
    d_ff: int
    num_blocks: int

    @property
    def params(self) -> int:
        """Parameters Ψ: two d_model x d_ff weights per block."""
        return self.num_blocks * 2 * self.d_model * self.d_ff

    def activation_bytes(self, batch: int, seq: int, bytes_per_value: int = 2) -> int:
        """Activations saved for backward (bf16): each block keeps its input (d_model) and hidden (d_ff) per token."""
        return self.num_blocks * batch * seq * (self.d_model + self.d_ff) * bytes_per_value


XXL = FFNModel(d_model=16384, d_ff=53248, num_blocks=126)


def fsdp_bytes_per_device(n: int, params: int, activations: int, state_bytes: int = 16,
                          sharded_activations: Fraction = Fraction(1, 2)) -> Fraction:
    """Per-device bytes under FSDP on `n` devices: model states (fp32 master 4 + gradient 4 + Adam 8 bytes per
    parameter) all sharded, and `sharded_activations` of the activations sharded (the rest held whole)."""
    sharded = state_bytes * params + sharded_activations * activations
    return sharded / n + (1 - sharded_activations) * activations


def devices_needed(capacity_bytes: int, params: int, activations: int, state_bytes: int = 16,
                   sharded_activations: Fraction = Fraction(1, 2)) -> int | None:
    """The fewest devices whose per-device FSDP memory fits `capacity_bytes`; None if no number of devices does
    (the unsharded part of the activations alone is too big). Exact arithmetic, no float rounding."""
    room = capacity_bytes - (1 - sharded_activations) * activations
    if room <= 0:
        return None
    return max(1, math.ceil((state_bytes * params + sharded_activations * activations) / room))
