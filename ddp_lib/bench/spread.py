"""Medians with their spread, and verdicts that say so when a difference lies inside the spread."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable

#: The fewest measurements a verdict is drawn from: one profiled step shows no spread to judge a difference by.
MIN_SAMPLES = 5


@dataclass(frozen=True)
class Spread:
    """A sample's median, quartiles (q1, q3), extremes and size."""

    median: float
    q1: float
    q3: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, xs: Iterable[float]) -> "Spread":
        """The spread of `xs` (quartiles by the inclusive method: they stay inside the sample's range)."""
        v = sorted(float(x) for x in xs)
        if not v:
            raise ValueError("no measurements")
        q1, _, q3 = statistics.quantiles(v, n=4, method="inclusive") if len(v) > 1 else (v[0], v[0], v[0])
        return cls(statistics.median(v), q1, q3, v[0], v[-1], len(v))

    def scaled(self, k: float) -> "Spread":
        """The same sample divided by `k` (per pair instead of per step); `k` > 0."""
        return Spread(self.median / k, self.q1 / k, self.q3 / k, self.lo / k, self.hi / k, self.n)

    def __str__(self) -> str:
        return f"{self.median:.1f} (IQR {self.q1:.1f}-{self.q3:.1f}, n={self.n})"


def compare(before: Spread, after: Spread) -> str:
    """"lower" or "higher" when `after`'s interquartile range lies wholly below or above `before`'s; "within the
    spread" when the two ranges overlap; "too few samples" when either has fewer than MIN_SAMPLES."""
    if min(before.n, after.n) < MIN_SAMPLES:
        return "too few samples"
    if after.q3 < before.q1:
        return "lower"
    if after.q1 > before.q3:
        return "higher"
    return "within the spread"


def verdict(before: Spread, after: Spread, lower: str = "lower", higher: str = "higher") -> str:
    """A sentence for a change from `before` to `after`, naming the two medians with their ranges: `lower`/`higher`
    only when `compare` finds the ranges apart, otherwise saying that the medians' difference is inside the spread."""
    what = compare(before, after)
    core = f"{before.median:.1f} -> {after.median:.1f} (IQR {before.q1:.1f}-{before.q3:.1f} -> {after.q1:.1f}-{after.q3:.1f})"
    if what == "lower":
        return f"{core}: {lower}"
    if what == "higher":
        return f"{core}: {higher}"
    if what == "too few samples":
        return f"{core}: no verdict, fewer than {MIN_SAMPLES} steps per configuration"
    return f"{core}: no verdict, the difference is inside the spread (the ranges overlap)"
