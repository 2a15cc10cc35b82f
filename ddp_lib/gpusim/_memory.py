"""Per-GPU memory of the simulation: bytes held by live simulated tensors, counted against the profile's capacity.

A storage is counted once however many tensors view it (keyed by its CPU data pointer) and released when the last
simulated tensor holding it is collected. Sizes round up to 512 bytes, the CUDA caching allocator's smallest block.
Every simulated tensor's inner CPU tensor carries a plain weak reference whose callback releases its count (a
`weakref.finalize` per tensor cost about 6 us to create and as much again to fire, on every op's output).
"""

from __future__ import annotations

import threading
import weakref

import torch

_BLOCK = 512
_lock = threading.Lock()
_storages: dict[int, list] = {}  # data_ptr -> [nbytes, live tensors, device index]
_pending: list[int] = []  # storages of tensors that died while the lock was held, released by settle()
_refs: dict[int, tuple] = {}  # id(weak reference to an inner tensor) -> (that reference, its storage's data_ptr)
allocated: dict[int, int] = {}
peak: dict[int, int] = {}
top: dict[int, int] = {}  # the process's peak per GPU, never reset (what dry mode records: ddp_lib.gpusim._peaks)
capacity: dict[int, int] = {}
names: dict[int, str] = {}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _card() -> str:
    from ddp_lib.gpusim import _box

    return _box.profile.name if _box.profile is not None else "GPU"


def _round(nbytes: int) -> int:
    return -(-nbytes // _BLOCK) * _BLOCK


def check(index: int, nbytes: int) -> None:
    """Raise torch.OutOfMemoryError, worded as CUDA's allocator does, when `nbytes` more do not fit on GPU `index`."""
    total, used = capacity.get(index, 0), current(index)
    if used + _round(nbytes) > total:
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {_gib(nbytes)}. GPU {index} has a total capacity of {_gib(total)} "
            f"of which {_gib(max(0, total - used))} is free. Of the allocated memory {_gib(used)} is allocated by "
            f"PyTorch (simulated {_card()}: ddp_lib.gpusim)")


def track(tensor: torch.Tensor, inner: torch.Tensor, index: int) -> None:
    """Count `inner`'s storage on GPU `index` while `tensor` (its simulated wrapper) lives."""
    if type(inner) is not torch.Tensor:  # torch.compile's fake (and functional) tensors hold no memory
        return
    storage = inner.untyped_storage()
    # a meta storage (dry mode) has no data pointer: its StorageImpl's address identifies it, as views share it
    ptr, nbytes = storage.data_ptr() or (storage._cdata if inner.is_meta else 0), storage.nbytes()
    if ptr == 0 or nbytes == 0:
        return
    with _lock:
        if _pending:  # what died since, first: its bytes are free for this one
            _settle_locked()
        entry = _storages.get(ptr)
        if entry is None or entry[2] != index:
            if entry is not None:  # a pointer reused across devices cannot be: treat as a new storage
                _release_entry(ptr)
            size = _round(nbytes)
            used = allocated.get(index, 0) + size
            if used > capacity.get(index, 0):
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {_gib(nbytes)}. GPU {index} has a total capacity of "
                    f"{_gib(capacity.get(index, 0))} (simulated {_card()}: ddp_lib.gpusim)")
            entry = _storages[ptr] = [size, 0, index]
            allocated[index] = used
            peak[index] = max(peak.get(index, 0), used)
            top[index] = max(top.get(index, 0), used)
        entry[1] += 1
        if _pending:  # what died during this (a collection inside the lock): counted after this one's increment
            _settle_locked()
    # on the inner tensor: module._apply swaps wrappers, refused if weakly held; the reference lives in _refs until
    # its callback runs
    ref = weakref.ref(inner, _dead)
    _refs[id(ref)] = (ref, ptr)


def _release_entry(ptr: int) -> None:
    size, _, index = _storages.pop(ptr)
    allocated[index] = allocated.get(index, 0) - size


def _dead(ref) -> None:
    """A simulated tensor's inner tensor died: release its storage's count, or leave it for `settle` when the lock
    is taken. The callback can run inside `track`'s locked part, on the thread that holds the lock (any allocation
    there may start a garbage collection that frees a tensor held in a cycle): waiting for the lock would deadlock."""
    _pending.append(_refs.pop(id(ref))[1])  # list.append: atomic under the GIL
    if _lock.acquire(blocking=False):
        try:
            _settle_locked()
        finally:
            _lock.release()


def _settle_locked() -> None:
    while _pending:
        ptr = _pending.pop()
        entry = _storages.get(ptr)
        if entry is None:
            continue
        entry[1] -= 1
        if entry[1] <= 0:
            _release_entry(ptr)


def settle() -> None:
    """Apply the releases that arrived while the lock was held: before any figure is read."""
    if _pending:
        with _lock:
            _settle_locked()


def current(index: int) -> int:
    """Bytes allocated on GPU `index` now (torch.cuda.memory_allocated)."""
    settle()
    return allocated.get(index, 0)


def highest(index: int) -> int:
    """The peak since the last reset (torch.cuda.max_memory_allocated)."""
    settle()
    return peak.get(index, 0)


def reset_peak(index: int) -> None:
    """torch.cuda.reset_peak_memory_stats: the peak restarts from what is allocated now."""
    peak[index] = current(index)
