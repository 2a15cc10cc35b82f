"""Data for the lessons: splitting a global batch (lesson 02) or a dataset by rank."""

from __future__ import annotations

from typing import Sequence

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


def shard(dataset: Sequence, rank: int, world_size: int):
    """Rank `rank`'s disjoint, equal-size, strided slice (rows rank, rank+W, ...); the last len % W rows are dropped.

    Equal sizes keep every rank at the same number of steps (a rank with one batch more would wait
    forever in the all-reduce). Works on a datasets.Dataset (via select) or any indexable sequence.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    per = len(dataset) // world_size
    if per == 0:
        raise ValueError(f"{len(dataset)} rows cannot give each of {world_size} ranks at least one")
    index = range(rank, per * world_size, world_size)
    if hasattr(dataset, "select"):
        return dataset.select(index)
    return [dataset[i] for i in index]
