"""The simulated box itself: its GPUs' profile (set once by `activate`), the host thread's current device, and the
collectives in flight on the streams.

The lowest module of the simulation: the tensors (`_tensor`) resolve `cuda` to a device here, and `torch.cuda`
(`_cuda`) reads and sets the same state.
"""

from __future__ import annotations

import threading

from ddp_lib.gpusim._profiles import Profile

profile: Profile | None = None
current = 0  # torch.cuda.current_device()
# collectives whose `wait()` returned without the host waiting (SimWork): as on a stream, the next op on a simulated
# tensor, a synchronize, or an event recorded after them waits for them first (`drain`)
pending: list = []
_drain_lock = threading.RLock()


def drain() -> None:
    """Complete every collective in flight: what the stream does before its next kernel."""
    with _drain_lock:
        while pending:
            pending.pop(0).complete()


def check_index(index: int | None) -> int:
    """The device index (the current device for None), or CUDA's error for a GPU this box does not have."""
    index = current if index is None else index
    if not 0 <= index < profile.count:
        raise RuntimeError(f"CUDA error: invalid device ordinal (device {index}; this box has {profile.count} GPUs)")
    return index
