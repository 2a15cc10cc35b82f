"""Lesson 09: what a communication hook registered on BucketedDDP sees of a bucket, and how its future is waited for."""

from __future__ import annotations

import torch
import torch.nn as nn


def flat_views(buffer: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """One view of the flat `buffer` per parameter, in order, shaped like it (a bucket's gradient slots)."""
    views, offset = [], 0
    for p in params:
        views.append(buffer[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


class HookBucket:
    """What a communication hook sees of one bucket: the part of torch's `GradBucket` its own hooks call."""

    def __init__(self, bucket, index: int, n_buckets: int):  # bucket: a ddp_lib.ddp.bucketed.Bucket
        self._bucket, self._index, self._n = bucket, index, n_buckets
        self._buffer = bucket.buffer

    def index(self) -> int:
        """The bucket's position in launch order (0 launches first)."""
        return self._index

    def is_last(self) -> bool:
        """True for the last bucket launched in a backward (torch: `bucket_index == num_buckets - 1`)."""
        return self._index == self._n - 1

    def buffer(self) -> torch.Tensor:
        """The flat buffer holding the bucket's local gradients (summed, not yet divided by the world size)."""
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer the hook works on; its content is copied back into the bucket when it completes."""
        self._buffer = tensor

    def parameters(self) -> list[nn.Parameter]:
        return list(self._bucket.params)

    def gradients(self) -> list[torch.Tensor]:
        """One view of `buffer()` per parameter, shaped like the parameter (torch's `GradBucket.gradients`)."""
        if self._buffer is self._bucket.buffer:
            return list(self._bucket.views)  # the bucket's own views, built once
        return flat_views(self._buffer, self._bucket.params)


class HookWork:
    """A hook's future, waited for like a `dist.Work`: on wait, its tensor is copied `into` the bucket's buffer."""

    def __init__(self, future: torch.futures.Future, into: torch.Tensor):
        if not isinstance(future, (torch.futures.Future, torch._C.Future)):  # .then() gives the C++ type
            raise TypeError(f"a comm hook must return a torch.futures.Future, got {type(future).__name__}")
        self.future, self.into = future, into

    def wait(self) -> None:
        future, self.future = self.future, None  # nothing of the hook outlives its wait
        result = future.wait()
        if isinstance(result, (list, tuple)):  # a raw all-reduce future: [tensor]
            result = result[0]
        buffer = self.into
        if result.data_ptr() != buffer.data_ptr() or result.numel() != buffer.numel():
            buffer.copy_(result.reshape(buffer.shape))
