"""A forward and each gradient of BucketedDDP walk only down through the package's modules.

Traced with `sys.setprofile` on 2 gloo ranks: every Python call into a `ddp_lib` module is attributed to the nearest
`ddp_lib` frame below it on the stack (the caller, seen through torch's and the standard library's frames, e.g.
`contextlib`), or starts a leg when there is none (the test calling the wrapper, autograd calling a hook or the
end-of-backward callback). A leg ends when its first frame returns: the landing leg includes what the wrapper does
after the all-reduces landed (the step state, publishing `comm_calls`), so that bookkeeping may not call back up
either. A generator resumed (a `@contextmanager` leaving its block) is not a new entry.

A leg's walk is the set of (caller module -> called module) edges. It goes only down when no package module is
entered twice: each module is entered from one module only, and never the leg's first module again (calling the
same lower module twice from one module is one edge, not a second entry). The walks traced: the forward that
rebuilds the buckets, a forward after it, and that step's gradients and landing, hooked once per bucket.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ddp_lib.ddp import BucketedDDP
from ddp_lib.launch import spawn

from call_legs import trace_legs


def _trace(fn) -> list[dict]:
    """Run `fn()` traced (tests/call_legs.py); its legs as the ranks send them back: entry, edges, calls."""
    return [{k: leg[k] for k in ("entry", "edges", "calls")} for leg in trace_legs(fn)]


def _traced_steps() -> dict[str, list[dict]]:
    """Rank body: one step, the forward that rebuilds the buckets (traced), two more steps, then a traced forward
    and a traced backward."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)], nn.BatchNorm1d(64))  # a buffer to broadcast
    ddp = BucketedDDP(model, bucket_size_mb=0.03, first_bucket_mb=0.03)  # 2 buckets of 2 layers
    x = torch.randn(8, 64)
    ddp(x).sum().backward()
    ddp.finish_gradient_synchronization()
    out = {}
    out["rebuild_forward"] = _trace(lambda: out.setdefault("loss", ddp(x).sum()))
    out.pop("loss").backward()
    ddp.finish_gradient_synchronization()
    for _ in range(2):
        ddp(x).sum().backward()
        ddp.finish_gradient_synchronization()
    out["forward"] = _trace(lambda: out.setdefault("loss", ddp(x).sum()))
    out["backward"] = _trace(out.pop("loss").backward)
    ddp.finish_gradient_synchronization()
    out["rebuilt"] = [ddp.rebuilt, ddp.sync.per_bucket.on]
    return out


def _goes_down(edges: list[tuple[str, str]], entry: str) -> bool:
    """No module entered twice: every called module has one caller module, and the entry's is never called."""
    callers: dict[str, str] = {entry.split(":")[0]: ""}
    for caller, called in edges:
        if callers.setdefault(called, caller) != caller:
            return False
    return True


def test_a_forward_and_each_gradient_walk_only_down():
    out = spawn(_traced_steps, world_size=2, timeout_s=120)[0]
    assert out["rebuilt"] == [True, True], out["rebuilt"]
    forwards = out["rebuild_forward"] + out["forward"]
    assert [leg["entry"] for leg in forwards] == ["contract.py:DataParallelWrapper.forward"] * 2, forwards
    assert any(call.endswith(":broadcast") for call in out["rebuild_forward"][0]["calls"])  # rank 0's order
    legs = out["backward"]
    hooks = [leg for leg in legs if "hook" in leg["entry"]]
    launches = [leg for leg in hooks if any(called == "comm.py" for _, called in leg["edges"])]
    landings = [leg for leg in legs if "_end_of_backward" in leg["entry"]]
    assert len(hooks) == 2 and len(launches) == 2 and len(landings) == 1, legs  # one hook per bucket, both sent
    assert any(call.endswith(":wait_all") for call in landings[0]["calls"]), landings  # the leg reaches the landing
    for leg in forwards + legs:
        assert _goes_down(leg["edges"], leg["entry"]), (leg["entry"], leg["edges"], leg["calls"])
    # front -> strategy -> {its bucket, its per-bucket part, its door to the collectives} -> comm -> bookkeeping
    # (the rebuilding forward, once per run, also plans and allocates: it only has to go down)
    assert all(len(leg["edges"]) <= 6 for leg in out["forward"] + legs), out["forward"] + legs


def test_the_walk_check_catches_a_module_entered_twice():
    """The check itself: a module called from two modules, or the entry's module called back, is refused."""
    entry = "contract.py:f"
    assert _goes_down([("contract.py", "a.py"), ("a.py", "b.py"), ("a.py", "comm.py")], entry)
    assert not _goes_down([("contract.py", "a.py"), ("a.py", "comm.py"), ("contract.py", "comm.py")], entry)
    assert not _goes_down([("contract.py", "a.py"), ("a.py", "contract.py")], entry)
