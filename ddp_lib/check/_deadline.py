"""A deadline for the learner's code inside a check: past it, the code is interrupted, and the check reports
"did not return within N s" instead of freezing the notebook.

    with time_limit(5.0):            # raises TimedOut once 5 s have passed, wherever the code runs Python
        learner_fn(...)

A watchdog thread raises an exception in the thread that runs the code (`PyThreadState_SetAsyncExc`), so nothing
keeps running after the limit: the rank is free for the next property and the next cell. The exception derives
from `BaseException`, so a learner's `except Exception` does not swallow it (and it is raised again every second
until the code gives up). What it cannot interrupt is a call blocked inside C++: such a call must have a deadline
of its own (a store handed to the learner gets a short timeout, see `short_timeout_store`; the collective guard
bounds its waits). And a collective must never be interrupted between "every rank agreed" and its return (the
peers would enter it alone): the guard's calls run `shielded()`, and the exception waits until they return.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

import torch.distributed as dist

from ddp_lib.check._collective_guard import Guard

REFIRE_S = 1.0  # how often the interrupt is raised again when the learner's code caught it


class DeadlinePassed(BaseException):
    """Raised inside the learner's code when its time is up (each `time_limit` raises a subclass of its own)."""


class TimedOut(Exception):
    """The code run under `time_limit` did not return within its limit."""


_lock = threading.Lock()
_shield: dict[int, int] = {}  # thread id -> depth of shielded() calls in progress
_fired: dict[int, list[type]] = {}  # thread id -> the exceptions of the limits that have fired and are still open


def _raise_in(tid: int, exc: type | None) -> None:
    """Raise `exc` in thread `tid` at its next Python instruction (None: drop one still pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(exc) if exc else None)


def _importing(tid: int) -> bool:
    """True while thread `tid` runs an import statement."""
    frame = sys._current_frames().get(tid)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


@contextmanager
def time_limit(seconds: float, what: str = "it") -> Iterator[None]:
    """Run the body with a deadline: past `seconds`, raise `TimedOut("<what> did not return within N s")`."""
    tid = threading.get_ident()
    exc = type("DeadlinePassed", (DeadlinePassed,), {})
    stop, state = threading.Event(), {"open": True, "fired": False}

    def watchdog() -> None:
        if stop.wait(seconds):
            return
        while True:
            with _lock:
                if not state["open"]:
                    return
                # never between "every rank agreed" and the collective's return, never inside an import (a module
                # left half-initialised would break later cells; a first import may take seconds on a busy machine)
                if not _shield.get(tid) and not _importing(tid):
                    if not state["fired"]:
                        _fired.setdefault(tid, []).append(exc)
                    state["fired"] = True
                    _raise_in(tid, exc)
            if stop.wait(REFIRE_S if state["fired"] else 0.005):
                return

    threading.Thread(target=watchdog, name="check-deadline", daemon=True).start()
    try:
        yield
    except exc:
        raise TimedOut(f"{what} did not return within {seconds:g} s") from None
    finally:
        # Closed first, under the lock: from then on the watchdog raises nothing. An interrupt that lands while this
        # closes is this limit's own (the watchdog refires only after REFIRE_S): close again. Waking the watchdog
        # came first once, and an interrupt that landed inside Event.set() escaped the check; the limit, still open,
        # went on raising every second in whatever ran next (a CI run: in the check's gather, then in launch).
        while True:
            try:
                with _lock:
                    if exc in _fired.get(tid, ()):
                        _fired[tid].remove(exc)
                        if not _fired[tid]:
                            del _fired[tid]
                    state["open"] = False
                    if state["fired"]:
                        _raise_in(tid, None)  # one fired as the body returned: the body's outcome stands
                break
            except exc:
                continue
        stop.set()


@contextmanager
def shielded() -> Iterator[None]:
    """No deadline interrupts the body (a collective); one that passed before it starts is raised here, at once."""
    tid = threading.get_ident()
    entered = False
    try:
        with _lock:
            _shield[tid] = _shield.get(tid, 0) + 1
            entered = True
            fired = list(_fired.get(tid, ()))
        if fired:  # the limit passed (and may have been caught by the learner): refuse to enter the collective
            _raise_in(tid, None)
            raise fired[-1]()
        yield
    finally:
        if entered:
            with _lock:
                _shield[tid] -= 1


def short_timeout_store(store: dist.Store, seconds: float) -> dist.Store:
    """A store on its own connection whose blocking calls (get, wait) give up after `seconds`.

    A copy (`clone()`, a new TCP client): a call still blocked in it holds no lock of the default store's
    connection, and its timeout is its own (`set_timeout` on a `PrefixStore` changes the store it wraps)."""
    try:
        mine = store.clone()
    except (AttributeError, RuntimeError):  # a store without clone (HashStore, FileStore): the original
        return store
    mine.set_timeout(timedelta(seconds=seconds))
    return mine



class ShieldedGuard(Guard):
    """The collective guard, whose collectives a deadline never interrupts (see `shielded`)."""

    def _wrap(self, name: str, fn: Callable) -> Callable:
        guarded = super()._wrap(name, fn)

        def call(*args, **kwargs):
            with shielded():
                return guarded(*args, **kwargs)

        call.__wrapped__ = fn
        return call
