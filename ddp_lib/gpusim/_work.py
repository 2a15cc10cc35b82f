"""The simulated NCCL group's options and works. As under NCCL, `wait()` does not block the host: it orders the
stream, so the next op on a simulated tensor (or a synchronize, or an event recorded after it) waits for the data
(`_box.drain`), and a host clock read right after `wait()` reads near zero, as on a box. `is_completed()` stays False
until the host synchronizes. A work on CPU tensors (gloo's, in a "cpu:gloo,cuda:nccl" group) and a barrier block the
host, as theirs do."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ddp_lib.gpusim import _box, _cuda


class Options:
    """Stands for ProcessGroupNCCL.Options: the fields distributed_c10d sets."""

    def __init__(self, is_high_priority_stream: bool = False) -> None:
        self.is_high_priority_stream = is_high_priority_stream
        self._timeout = datetime.timedelta(minutes=10)
        self.global_ranks_in_group: list[int] = []
        self.group_name = ""
        self.split_from = None
        self.split_color = 0
        self.config = None


class SimWork(dist.Work):
    """A collective in flight: `wait()` orders the stream (the host goes on); completion needs a host sync."""

    def __init__(self, gloo_work, result: list, after=None, host: bool = False) -> None:
        super().__init__()
        self._gloo, self._result, self._after, self._synced_at = gloo_work, result, after, _cuda._syncs
        self._host, self._done, self._queued = host, False, False

    def complete(self) -> None:
        """The data has arrived (the host waits for it now)."""
        if self._done:
            return
        if self._gloo is not None:
            self._gloo.wait()
        if self._after is not None:
            self._after()
            self._after = None
        self._done = True

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:  # noqa: ARG002
        """NCCL's wait orders the current stream after the collective; the host goes on (gloo's waits)."""
        if self._host:
            self.complete()
        elif not self._done and not self._queued:
            self._queued = True
            _box.pending.append(self)
        return True

    def is_completed(self) -> bool:
        """Complete once the host has synchronized with the device after the collective was issued."""
        return (self._gloo is None or self._gloo.is_completed()) and _cuda._syncs > self._synced_at

    def is_success(self) -> bool:
        """No failure is simulated."""
        return True

    def get_future(self) -> torch.futures.Future:
        """A future holding the collective's output tensors (the simulated CUDA ones)."""
        fut = torch.futures.Future()
        self.wait()
        fut.set_result(self._result)
        return fut

    def synchronize(self) -> None:
        """The host waits (as Work.synchronize on a CUDA work)."""
        self.complete()


class _Chain(SimWork):
    """Several works waited as one."""

    def __init__(self, works: list, result: list) -> None:
        super().__init__(None, result, host=any(w._host for w in works))
        self._works = works

    def complete(self) -> None:
        """Complete each."""
        for w in self._works:
            w.complete()
        self._done = True
