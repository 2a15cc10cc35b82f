"""Lesson 05: BucketedDDP's one-hook-per-bucket mode: one Python hook call per bucket instead of one per gradient.

Once the bucket plan is final, each bucket is hooked once, on the parameter whose gradient arrived last in it on
this rank. At each synchronizing forward every `.grad` is made its bucket's view (`Bucket.bind_grads`), so each
in-place accumulation bumps the buffer's version counter; the hook counts the bucket full when the counter moved by
its number of parameters (`full`). A count that does not add up (gradients in another order, a `.grad` replaced
between forward and backward) leaves that bucket and every later one to backward's end, and from the next step the
engine hooks every gradient, for good. The count only decides when to send: when backward ends, a bucket that
changed after it was sent, or one of whose `.grad`s is no longer its view (`late`), may have missed a gradient.

This part reads the buckets' attributes and calls nothing: the strategy calls the buckets and the collectives.
"""

from __future__ import annotations

import torch.nn as nn

from ddp_lib.ddp.bucket import Bucket

__all__ = ["PerBucketHooks"]


class PerBucketHooks:
    """The mode's state for one engine: on or off, each bucket's version once bound, and once sent."""

    def __init__(self) -> None:
        self.on = False  # hooked once per bucket (its last gradient) rather than once per gradient
        self.bound: list[int] = []  # per bucket: its buffer's version once the step's gradients were bound to it
        self.sent: dict[int, int] = {}  # bucket index -> its buffer's version right after it was launched
        self.unproven = False  # a bucket's count did not add up in this backward

    @staticmethod
    def last_arrived(buckets: list[Bucket], arrivals: list[int], slots: dict[int, tuple[Bucket, int]]
                     ) -> list[nn.Parameter]:
        """Per bucket, the parameter whose gradient arrived last on this rank (`arrivals`: hook indices in order)."""
        last = {}
        for k in arrivals:
            bucket, i = slots[k]
            last[bucket] = bucket.params[i]
        return [last[b] for b in buckets]

    def begin(self, bound: list[int]) -> None:
        """A synchronizing forward bound every bucket's gradients at these versions."""
        self.bound, self.unproven = bound, False
        self.sent.clear()

    def full(self, j: int, bucket: Bucket) -> bool:
        """Whether bucket `j`'s version moved by exactly its number of parameters since it was bound, what one
        in-place accumulation per parameter gives; if so it counts as full. A count, not a proof: a gradient
        accumulated twice can stand in for one still to come, and `late` catches that when backward ends."""
        if bucket.buffer._version - self.bound[j] != len(bucket.params):
            self.unproven = True  # this bucket waits for backward's end; the next step is hooked per gradient
            return False
        bucket.pending = 0
        return True

    def note_sent(self, j: int, bucket: Bucket) -> None:
        self.sent[j] = bucket.buffer._version

    def late(self, buckets: list[Bucket]) -> list[int]:
        """After backward: the sent buckets that changed since, or one of whose `.grad`s is no longer its view (a
        write through `.data` would escape the version): their average may miss a gradient."""
        return [j for j, version in self.sent.items()
                if buckets[j].buffer._version != version
                or not all(p.grad is v for p, v in zip(buckets[j].params, buckets[j].views))]
