"""Rank-side code of the rank-0 checkpoint habit test: `if rank == 0: torch.save(model.state_dict(), path)`."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddp_lib.fsdp import FSDP
from ddp_lib.kit.models import ToyModel


def _attempt(fn) -> dict:
    """What `fn()` raised (type and message) and how long it took."""
    t0 = time.monotonic()
    try:
        fn()
        return {"raised": None, "s": time.monotonic() - t0}
    except Exception as err:  # noqa: BLE001 -- the test reads the type and the message
        return {"raised": type(err).__name__, "msg": str(err), "s": time.monotonic() - t0}


def rank0_habit(directory: str) -> dict:
    rank = dist.get_rank()
    store = c10d._get_default_store()
    torch.manual_seed(0)
    model = FSDP(ToyModel(), debug=True)  # case 3 needs the forward's entry agreement, which only debug runs
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    out: dict = {}

    # 1. rank 0 alone, its peer idle (a `%%rank [0]` cell): an error on rank 0 within entry_timeout_s
    model.entry_timeout_s = 1.0
    if rank == 0:
        out["alone"] = _attempt(lambda: torch.save(model.state_dict(), Path(directory) / "alone.pt"))
        store.set("habit/alone-done", "1")
    else:
        store.wait(["habit/alone-done"])

    # 2. the group is still usable: a forward and state_dict() on every rank agree
    model.entry_timeout_s = 30.0
    model(x).sum().backward()
    opt.step()
    sd = model.state_dict()
    out["after_alone"] = {k: v.clone() for k, v in sd.items()}

    # 3. rank 0 alone while its peer goes on to the next step: both raise at once (30 s is not waited)
    if rank == 0:
        out["moved_on"] = _attempt(lambda: torch.save(model.state_dict(), Path(directory) / "moved_on.pt"))
    else:
        out["moved_on"] = _attempt(lambda: model(x).sum().backward())

    # 4. the pattern that works: state_dict() on every rank, save on rank 0; training goes on
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    sd = model.state_dict()
    if rank == 0:
        torch.save(sd, Path(directory) / "good.pt")
    dist.barrier()
    plain = ToyModel()
    plain.load_state_dict(torch.load(Path(directory) / "good.pt", weights_only=True))
    out["saved_equals_gathered"] = all(torch.equal(plain.state_dict()[k], v) for k, v in sd.items())
    out["final"] = {k: v.clone() for k, v in sd.items()}
    return out


def lifecycle() -> dict:
    """A unit's states through its verbs, and what forward and backward leave (every unit SHARDED)."""
    from ddp_lib.fsdp.unit_group import UnitState

    torch.manual_seed(0)
    plain = ToyModel()
    want = {k: v.clone() for k, v in plain.state_dict().items()}
    model = FSDP(plain)
    u = model.units[model.module.layers[0]]
    seen = [u.state.name]
    errors = []
    try:
        u.wait_for_unshard()
    except RuntimeError as err:
        errors.append(str(err))
    u.unshard()
    seen.append(u.state.name)
    try:
        u.unshard()
    except RuntimeError as err:
        errors.append(str(err))
    fulls = u.wait_for_unshard()
    seen.append(u.state.name)
    equal = torch.equal(fulls[0], want["layers.0.weight"])
    u.reshard()
    seen.append(u.state.name)
    during = []
    head = model.units[model.module.head]
    model.module.layers[1].register_forward_pre_hook(  # runs after FSDP's own pre-forward hook
        lambda m, a: during.append((u.state.name, model.units[m].state.name, head.state.name)))
    x = torch.randn(4, 32)
    model(x).sum().backward()
    after = {n: v.state.name for n, v in ((v.name, v) for v in model.units.values())}
    model.finish_gradient_synchronization()
    kept = model.state_dict(keep_vars=True)
    plain = model.state_dict()
    refused = []
    for call in (lambda: model.state_dict(None, "p."), lambda: model.load_state_dict(plain, assign=True)):
        try:
            call()
        except TypeError as err:
            refused.append(str(err))
    args = {"keep_vars_bias_is_the_parameter": kept["layers.0.bias"] is model.module.layers[0].bias,
            "plain_bias_is_a_copy": plain["layers.0.bias"] is not model.module.layers[0].bias
            and not isinstance(plain["layers.0.bias"], torch.nn.Parameter),
            "same_values": all(torch.equal(kept[k].detach(), v) for k, v in plain.items()),
            "prefixed": sorted(model.state_dict(prefix="p.")) == sorted("p." + k for k in plain),
            "refused": len(refused)}
    return {"seen": seen, "errors": errors, "equal": equal, "during": during, "after": after,
            "UnitState": [s.name for s in UnitState], "state_dict_args": args}


def versus_fully_shard() -> dict:
    """The course's FSDP and torch's fully_shard, same model and batches, fp32 and bf16 compute."""
    import torch.nn as nn

    from ddp_lib.bench.fsdp_compare import side_by_side

    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 32, generator=g), torch.randint(0, 8, (8,), generator=g)) for _ in range(3)]
    return {str(dt): side_by_side(ToyModel, batches, (nn.Linear,), dt) for dt in (None, torch.bfloat16)}


def sharded_with_optimizer(directory: str) -> dict:
    """The course's sharded checkpoint with the optimizer: a fresh FSDP and AdamW resume the same next step."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 32, generator=g)

    def step(model, opt):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    torch.manual_seed(0)
    model = FSDP(ToyModel())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt), step(model, opt)
    model.save_sharded(Path(directory) / "sharded", opt)
    step(model, opt)
    torch.manual_seed(3)
    again = FSDP(ToyModel())
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    again.load_sharded(Path(directory) / "sharded", opt2)
    step(again, opt2)
    want, got = model.gather_full_params(), again.gather_full_params()
    return {"resumed_diff": max((want[n] - got[n]).abs().max().item() for n in want)}


def run(directory: str, dcp_directory: str) -> dict:
    import fsdp_dcp_cases

    return {**rank0_habit(directory), "lifecycle": lifecycle(), "fully_shard": versus_fully_shard(),
            "sharded_optim": sharded_with_optimizer(directory), "dcp": fsdp_dcp_cases.reader(dcp_directory)}


def entry_numbers() -> dict:
    """How many entry agreements (store round trips) two training steps and one state_dict() cost, per debug."""
    out = {}
    for debug in (False, True):
        torch.manual_seed(0)
        model = FSDP(ToyModel(), debug=debug)
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
        for _ in range(2):
            model(x).sum().backward()
        model.state_dict()
        out[debug] = model._guards.entered
    return out
