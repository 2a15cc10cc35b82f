"""Legs of package calls, traced with `sys.setprofile`: the walk tests' one tracer.

Every Python call into a `ddp_lib` module is attributed to the nearest `ddp_lib` frame below it on the stack (its
caller, seen through torch's and the standard library's frames, e.g. `contextlib`), or starts a leg when there is
none (autograd calling a hook, an autograd function's backward or the end-of-backward callback). A leg ends when its
first frame returns. A generator resumed (a `@contextmanager` leaving its block) is not a new entry.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import ddp_lib

ROOT = os.path.dirname(ddp_lib.__file__) + os.sep


def module_of(frame) -> str | None:
    """The package module (path under ddp_lib/) a frame runs in, or None outside the package."""
    name = frame.f_code.co_filename
    return name[len(ROOT):] if name.startswith(ROOT) else None


def name_of(frame) -> str:
    """The frame's function, qualified (co_qualname: Python >= 3.11)."""
    code = frame.f_code
    return getattr(code, "co_qualname", code.co_name)


def trace_legs(run: Callable[[], Any]) -> list[dict]:
    """Run `run()` traced; one dict per leg: "entry" (module:function), "locals" (its first frame's arguments),
    "edges" (caller module -> called module, in the order first crossed), "calls", "modules" (every module entered)
    and "first" (the frame itself)."""
    outside = set()  # the frames below the traced region (the caller's own, the rank's launcher's)
    frame = sys._getframe()
    while frame is not None:
        outside.add(frame)
        frame = frame.f_back
    seen: set = set()
    legs: list[dict] = []
    current: dict | None = None

    def nearest_caller(frame):
        f = frame.f_back
        while f is not None and f not in outside and module_of(f) is None:
            f = f.f_back
        return None if f is None or f in outside else f

    def profile(frame, event, arg) -> None:
        nonlocal current
        mod = module_of(frame)
        if mod is None:
            return
        if event == "return":
            if current is not None and frame is current["first"]:
                current = None
            return
        if event != "call" or frame in seen:  # a resumed generator is not a new entry
            return
        seen.add(frame)
        caller = nearest_caller(frame)
        if caller is None:
            current = {"first": frame, "locals": dict(frame.f_locals), "entry": f"{mod}:{name_of(frame)}",
                       "edges": [], "calls": [], "modules": {mod}}
            legs.append(current)
        elif current is not None and module_of(caller) != mod:
            edge = (module_of(caller), mod)
            if edge not in current["edges"]:
                current["edges"].append(edge)
            current["calls"].append(f"{module_of(caller)} -> {mod}:{name_of(frame)}")
            current["modules"].add(mod)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return legs
