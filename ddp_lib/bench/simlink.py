"""A labelled, simulated network link: every all-reduce completes no sooner than α + bytes/bandwidth.

On 2 gloo ranks sharing 2 CPU cores, communication is CPU work (copies, the sum, loopback sockets) that takes
cores from backward, so overlapping it buys little: there is no idle hardware to hide it behind. A GPU cluster
is different: NCCL moves bytes over a link while the SMs compute. `SimulatedLink` gives the CPU run such a link:
the real gloo all-reduce still runs (the numbers stay exact), and its completion is held back until a stated
network would have delivered it. The link has one lane, as NCCL runs one process group's collectives one after
another on one CUDA stream per device (gloo, with its 2 worker threads by default, can run two at once): a call
starts on the link when it is issued or when the previous one leaves the link, whichever is later, and then
occupies it for α + bytes/bandwidth. The waiting is a sleep in one helper thread: it uses no CPU.

    with SimulatedLink(alpha_us=100, bandwidth_GBps=0.125):   # 1 Gb/s Ethernet, stated
        ...  # every dist.all_reduce (blocking or async) and torch DDP (via link_comm_hook) sees the link
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ddp_lib import comm


class LinkWork:
    """What an async all-reduce returns under the link: wait(), is_completed(), get_future(), like dist.Work."""

    def __init__(self, future: torch.futures.Future):
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        """Block until the link delivered the result (and the real collective finished)."""
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the link has delivered it."""
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        """A future completed when the link delivers (its value: [tensor])."""
        return self._future


class SimulatedLink:
    """Context manager: dist.all_reduce completes no sooner than α + bytes/bandwidth on a one-lane link."""

    active: "SimulatedLink | None" = None

    def __init__(self, alpha_us: float, bandwidth_GBps: float, label: str = ""):
        if alpha_us < 0 or bandwidth_GBps <= 0:
            raise ValueError(f"need alpha_us >= 0 and bandwidth_GBps > 0, got {alpha_us}, {bandwidth_GBps}")
        self.alpha_s, self.bandwidth = alpha_us * 1e-6, bandwidth_GBps * 1e9
        self.label = label or f"simulated link: α = {alpha_us:g} µs, {bandwidth_GBps:g} GB/s"
        self.clock = time.perf_counter  # replaced by a fake clock in tests
        self.sleep = time.sleep
        self._queue: queue.Queue = queue.Queue()
        self._free_at = 0.0  # when the link is next free (clock seconds)
        self._real = None
        self._thread: threading.Thread | None = None

    def cost_s(self, nbytes: int) -> float:
        """Seconds one all-reduce of `nbytes` occupies the link."""
        return self.alpha_s + nbytes / self.bandwidth

    def schedule(self, issued_s: float, nbytes: int) -> float:
        """When a call issued at `issued_s` leaves the link: after the previous call, then its own cost."""
        start = max(issued_s, self._free_at)
        self._free_at = start + self.cost_s(nbytes)
        return self._free_at

    def submit(self, work, tensor: torch.Tensor) -> torch.futures.Future:
        """Hand a real async collective to the link; the returned future completes when both are done."""
        future: torch.futures.Future = torch.futures.Future()
        self._queue.put((self.clock(), tensor.numel() * tensor.element_size(), work, tensor, future))
        return future

    def _deliver(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            issued, nbytes, work, tensor, future = item
            due = self.schedule(issued, nbytes)
            delay = due - self.clock()
            if delay > 0:
                self.sleep(delay)  # the link is busy: a sleep, no CPU
            try:
                if work is not None:
                    work.wait()
                future.set_result([tensor])
            except Exception as err:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(err)

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, async_op: bool = False):
        """dist.all_reduce through the link: the real call, async, then held until the link delivers it."""
        work = self._real(tensor, op=op, group=group, async_op=True)
        linked = LinkWork(self.submit(work, tensor))
        if async_op:
            return linked
        linked.wait()
        return None

    def __enter__(self) -> "SimulatedLink":
        if SimulatedLink.active is not None:
            raise RuntimeError("a SimulatedLink is already active")
        self._real = dist.all_reduce
        self._free_at = 0.0
        self._thread = threading.Thread(target=self._deliver, name="simulated-link", daemon=True)
        self._thread.start()
        dist.all_reduce = self.all_reduce  # engines call dist.all_reduce at run time: they all see the link
        SimulatedLink.active = self
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._real
        SimulatedLink.active = None
        self._queue.put(None)
        self._thread.join()


def link_comm_hook(state, bucket):  # no annotations: torch DDP compares them as objects
    """torch DDP comm hook: average the bucket with dist.all_reduce (through the active link, if any)."""
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(state))
    work = comm.all_reduce(buf, state, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
