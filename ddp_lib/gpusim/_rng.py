"""The simulated CUDA random number generators: one (seed, offset) pair per GPU, as CUDA's Philox generators keep.

`torch.cuda.get_rng_state` returns the 16 bytes a CUDA generator's state has (its seed, then its offset, each 8
bytes: the layout DTensor's `_PhiloxState` reads, torch/distributed/tensor/_random.py), `set_rng_state` sets them,
`torch.manual_seed` (through `torch.cuda.manual_seed_all`) seeds them with offset 0. Each random op on a simulated
GPU draws from a CPU generator seeded from the device's (seed, offset), then advances the offset by the op's element
count rounded up to 4, so the draws depend on the pair only: restoring a state repeats them, and DTensor's offsets
give shards different numbers. The numbers are not CUDA's Philox stream.
"""

from __future__ import annotations

import torch

_MASK = 2**64 - 1
_state: dict[int, list[int]] = {}  # device index -> [seed, offset]
_random: dict = {}  # aten op -> (draws random numbers, takes a `generator` argument)


def kind(func) -> tuple[bool, bool]:
    """Whether `func` draws random numbers, and whether its schema has a `generator` argument (cached)."""
    known = _random.get(func)
    if known is None:
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        known = _random[func] = (seeded, seeded and any(a.name == "generator" for a in func._schema.arguments))
    return known


def _pair(index: int) -> list[int]:
    return _state.setdefault(index, [torch.initial_seed() & _MASK, 0])


def generator(index: int) -> torch.Generator:
    """A CPU generator seeded from GPU `index`'s (seed, offset), for one random op."""
    seed, offset = _pair(index)
    return torch.Generator().manual_seed((seed ^ (offset * 0x9E3779B97F4A7C15)) & _MASK)


def advance(index: int, numel: int) -> None:
    """After a random op of `numel` elements: the offset moves on, by a multiple of 4 as Philox's does."""
    _pair(index)[1] += -(-numel // 4) * 4


def get_state(index: int) -> torch.Tensor:
    """The 16-byte state: seed and offset, little-endian uint64 each."""
    seed, offset = _pair(index)
    return torch.tensor([seed, offset], dtype=torch.uint64).view(torch.uint8)


def set_state(state: torch.Tensor, index: int) -> None:
    """Set GPU `index`'s (seed, offset) from a 16-byte state, as a CUDA generator's set_state requires."""
    if state.numel() != 16 or state.dtype != torch.uint8:
        raise RuntimeError("RNG state is wrong size")  # CUDAGeneratorImpl::set_state's check
    seed, offset = state.detach().cpu().contiguous().view(torch.uint64).tolist()
    _state[index] = [seed & _MASK, offset & _MASK]


def manual_seed(seed: int, index: int) -> None:
    """Seed GPU `index`'s generator: offset 0."""
    _state[index] = [int(seed) & _MASK, 0]
