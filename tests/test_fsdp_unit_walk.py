"""One FSDP unit's backward crosses at most 4 package modules: its lifecycle has one home (fsdp/unit_group.py).

Traced with `sys.setprofile` on 2 gloo ranks (tests/call_legs.py, as tests/test_gradient_walk.py traces a
gradient). A leg belongs to the unit it was called for (the note `unpack` gets, the group an autograd function's
`ctx` holds); a unit's walk is every package module its legs entered. torch's FSDP2 reaches about 3 modules per
unit (its state's hooks, `FSDPParamGroup`, its collectives); the course's: the group, its collectives, `comm` and
`comm`'s registry (`watch`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from call_legs import trace_legs
from ddp_lib.launch import spawn


def _unit_of(leg: dict) -> str | None:
    """The unit a leg works for: `unpack(note)` of a gathered weight, or an autograd function's `backward(ctx)`."""
    note, ctx = leg["locals"].get("note"), leg["locals"].get("ctx")
    if isinstance(note, tuple):
        return note[0][0].name
    return getattr(getattr(ctx, "group", None), "name", None)


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
    legs = trace_legs(loss.backward)
    model.finish_gradient_synchronization()
    walks: dict[str, set[str]] = {}
    for leg in legs:
        unit = _unit_of(leg)
        walks.setdefault(f"unit {unit}" if unit else leg["entry"], set()).update(leg["modules"])
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
