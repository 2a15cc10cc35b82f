"""One FSDP unit's backward crosses at most 4 package modules: its lifecycle has one home (fsdp/unit_group.py).

Traced with `sys.setprofile` on 2 gloo ranks, as tests/test_gradient_walk.py traces a gradient: every Python call
into a `ddp_lib` module whose nearest `ddp_lib` caller is none starts a leg (autograd calling a saved-tensor hook,
an autograd function's backward, a gradient hook, the end-of-backward callback). A leg belongs to the unit it was
called for (the note `unpack` gets, the group an autograd function's `ctx` holds); a unit's walk is every package
module its legs entered. torch's FSDP2 reaches about 3 modules per unit (its state's hooks, `FSDPParamGroup`, its
collectives); the course's: the group, its collectives, `comm` and `comm`'s registry (`watch`).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

import ddp_lib
from ddp_lib.launch import spawn

ROOT = os.path.dirname(ddp_lib.__file__) + os.sep


def _module(frame) -> str | None:
    name = frame.f_code.co_filename
    return name[len(ROOT):] if name.startswith(ROOT) else None


def _unit_of(frame) -> str | None:
    """The unit a leg's first frame works for: `unpack(note)` or an autograd function's `backward(ctx)`."""
    loc = frame.f_locals
    note, ctx = loc.get("note"), loc.get("ctx")
    if isinstance(note, tuple):
        return note[0][0].name
    group = getattr(ctx, "group", None)
    return getattr(group, "name", None)


def _traced_backward() -> dict:
    """Rank body: 2 untraced steps, then one traced backward; {unit or leg entry: [modules entered]}."""
    from ddp_lib.fsdp import FSDP

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)))
    x = torch.randn(8, 64)
    for _ in range(2):
        model(x).sum().backward()
        model.finish_gradient_synchronization()
    loss = model(x).sum()
    outside = set()
    frame = sys._getframe()
    while frame is not None:
        outside.add(frame)
        frame = frame.f_back
    seen: set = set()
    walks: dict[str, set[str]] = {}
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
        if event != "call" or frame in seen:
            return
        seen.add(frame)
        if nearest_caller(frame) is None:
            unit = _unit_of(frame)
            key = f"unit {unit}" if unit else f"{mod}:{frame.f_code.co_name}"
            current = {"first": frame, "walk": walks.setdefault(key, set())}
        if current is not None:
            current["walk"].add(mod)

    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    model.finish_gradient_synchronization()
    names = [u.name for u in dict.fromkeys(model.units.values())]
    return {"walks": {k: sorted(v) for k, v in walks.items()}, "units": names}


def test_one_fsdp_units_backward_crosses_at_most_4_package_modules():
    out = spawn(_traced_backward, world_size=2, timeout_s=180)[0]
    walks = out["walks"]
    units = {k: v for k, v in walks.items() if k.startswith("unit ")}
    assert sorted(units) == sorted(f"unit {n}" for n in out["units"]), walks  # every unit's backward was seen
    for unit, modules in units.items():
        assert "fsdp/unit_group.py" in modules and "comm.py" in modules, (unit, modules)  # it reduce-scattered
        assert len(modules) <= 4, (unit, modules)
