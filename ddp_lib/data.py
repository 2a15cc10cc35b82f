"""Data for the lessons: splitting a global batch or a dataset by rank."""

from __future__ import annotations

import torch


def shard_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal slice of a global batch; raises ValueError when it does not split evenly."""
    n = batch.shape[0]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if n % world_size:
        raise ValueError(
            f"a batch of {n} does not split evenly across {world_size} ranks: uneven local batches "
            f"would weight ranks unequally in the gradient average (use a global batch divisible by {world_size})"
        )
    per = n // world_size
    return batch[rank * per:(rank + 1) * per]
