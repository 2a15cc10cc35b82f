"""One gradient of BucketedDDP walks down through the package's modules, from its hook to its landed all-reduce.

Issue 38's measure: the walk crosses at most 6 module boundaries and never returns to a module it left. Traced with
`sys.setprofile` on 2 gloo ranks (one synchronized step after the bucket rebuild): every Python call into a
`ddp_lib` module is attributed to the nearest `ddp_lib` frame below it on the stack (the caller, seen through
torch's and the standard library's frames, e.g. `contextlib`), or starts a leg when there is none (autograd calling
a hook or the end-of-backward callback). A leg ends when its first frame returns: the landing leg includes what
the wrapper does after the all-reduces landed (the step state, publishing `comm_calls`), so that bookkeeping may not
call back down either. A generator resumed (a `@contextmanager` leaving its block) is not a new entry.

A leg's walk is the set of (caller module -> called module) edges. It goes only down when it is a chain: each module
is entered from one module only, the chain's order, so no module is entered again from another after it was left
(calling the same lower module twice from one module is one edge of the chain, not a return).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

import ddp_lib
from ddp_lib.ddp import BucketedDDP
from ddp_lib.launch import spawn

ROOT = os.path.dirname(ddp_lib.__file__) + os.sep


def _name(frame) -> str:
    code = frame.f_code
    return getattr(code, "co_qualname", code.co_name)  # co_qualname: Python >= 3.11


def _module(frame) -> str | None:
    name = frame.f_code.co_filename
    return name[len(ROOT):] if name.startswith(ROOT) else None


def _traced_step() -> list[dict]:
    """Rank body: 3 untraced steps (the rebuild happens at the second), then one traced; its legs."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # 4 x 16.6 KB of gradients
    ddp = BucketedDDP(model, bucket_size_mb=0.03, first_bucket_mb=0.03)  # 2 buckets of 2 layers
    x = torch.randn(8, 64)
    for _ in range(3):
        ddp(x).sum().backward()
        ddp.finish_gradient_synchronization()
    loss = ddp(x).sum()
    outside = set()  # the frames below the traced region (the test's own, the rank's launcher's)
    frame = sys._getframe()
    while frame is not None:
        outside.add(frame)
        frame = frame.f_back
    seen: set = set()
    legs: list[dict] = []
    current: dict | None = None

    def nearest_caller(frame):
        f = frame.f_back
        while f is not None and f not in outside and _module(f) is None:
            f = f.f_back
        return None if f is None or f in outside else f

    def profile(frame, event, arg) -> None:
        nonlocal current
        mod = _module(frame)
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
            current = {"first": frame, "entry": f"{mod}:{_name(frame)}", "edges": [], "calls": []}
            legs.append(current)
        elif current is not None and _module(caller) != mod:
            edge = (_module(caller), mod)
            if edge not in current["edges"]:
                current["edges"].append(edge)
            current["calls"].append(f"{_module(caller)} -> {mod}:{_name(frame)}")

    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    ddp.finish_gradient_synchronization()
    return [{k: v for k, v in leg.items() if k != "first"} for leg in legs]


def _is_chain(edges: list[tuple[str, str]], entry: str) -> bool:
    """The edges, in the order first crossed, form one path down from `entry`'s module: a -> b, b -> c, ..."""
    at = entry.split(":")[0]
    visited = {at}
    for caller, called in edges:
        if caller != at or called in visited:
            return False
        visited.add(called)
        at = called
    return True


def test_a_gradient_walks_down_in_at_most_6_boundaries():
    legs = spawn(_traced_step, world_size=2, timeout_s=120)[0]
    launches = [leg for leg in legs if any(called == "comm.py" for _, called in leg["edges"])
                and "hook" in leg["entry"]]
    landings = [leg for leg in legs if "_end_of_backward" in leg["entry"]]
    assert launches and len(landings) == 1, legs
    landing = landings[0]
    assert any(call.endswith(":wait_all") for call in landing["calls"]), landing  # the leg reaches the landing
    for leg in launches + landings + [leg for leg in legs if "hook" in leg["entry"]]:
        assert _is_chain(leg["edges"], leg["entry"]), (leg["entry"], leg["edges"], leg["calls"])
    walk = launches[0]["edges"] + landing["edges"]
    assert len(walk) <= 6, walk
    # the two legs are the same chain: wrapper -> engine -> collectives layer -> its bookkeeping
    assert launches[0]["edges"] == landing["edges"], (launches[0]["edges"], landing["edges"])
