"""Tied weights under `fully_shard`: the modules that share a parameter go into one FSDP group, as torch asks.

An LM whose output projection is its embedding (SmolLM2, the course's `TransformerLM`) holds one parameter in two
modules. `fully_shard` on each of them apart makes two FSDP groups that both manage it, and the first forward
refuses: "Parameter '...' is shared with a parameter already managed by another FSDP group. For shared/tied
parameters, use fully_shard([module_a, module_b]) to place them in the same FSDP group."
(torch/distributed/fsdp/_fully_shard/_fsdp_state.py, `_validate_no_duplicate_params`, in 2.13 and in 2.15).
`fully_shard([embed, lm_head])` makes one group: one all-gather and one reduce-scatter for the shared weight, which
stays one parameter. The course's `FSDP` finds the tie itself: one unit for both modules (`ddp_lib/fsdp/layout.py`).
"""

from __future__ import annotations

import torch.nn as nn

from ddp_lib.devices import needs_process_group


def tied_groups(model: nn.Module) -> list[list[nn.Module]]:
    """The modules of `model` that hold a parameter in common, one list per shared set, in module order."""
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), [])
            if m not in owners[id(p)]:
                owners[id(p)].append(m)
    groups: list[list[nn.Module]] = []
    for mods in owners.values():
        if len(mods) < 2:
            continue
        merged = [g for g in groups if any(m in g for m in mods)]
        group = [m for g in merged for m in g] + [m for m in mods if not any(m in g for g in merged)]
        groups = [g for g in groups if g not in merged] + [group]
    order = {m: i for i, m in enumerate(model.modules())}
    return sorted((sorted(g, key=order.__getitem__) for g in groups), key=lambda g: order[g[0]])


def shard_grouped(model: nn.Module, mesh, block_types: tuple[type, ...], group_tied: bool = True,
                  **fsdp_kwargs) -> nn.Module:
    """`fully_shard` every set of tied modules as one group (`group_tied=False`: each apart, the mistake), then each
    `block_types` module not already in a group, then the root."""
    from ddp_lib.compat import fsdp2

    fully_shard, _ = fsdp2()
    groups = tied_groups(model)
    grouped = {m for g in groups for m in g}
    for g in groups:
        if group_tied:
            fully_shard(g, mesh=mesh, **fsdp_kwargs)
        else:
            for m in g:
                fully_shard(m, mesh=mesh, **fsdp_kwargs)
    for m in [m for m in model.modules() if isinstance(m, block_types) and m not in grouped and m is not model]:
        fully_shard(m, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


@needs_process_group
def tied_side_by_side(preset: str = "tiny", steps: int = 3, batch: int = 4, lr: float = 0.1, seed: int = 0) -> dict:
    """On every rank: the course's `TransformerLM(preset)` (tied embedding and LM head) trained with the course's
    `FSDP` (a unit per `Block`) and with `fully_shard` grouped as torch asks, SGD on this rank's share of the same
    token batches; then `fully_shard` with the tied modules apart, and the error its first forward raises.

    Returns both loss curves, the largest difference of the full parameters at the end, whether each side kept the
    tie (one parameter), and `apart_error` (the error's text, or None where torch accepted it)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ddp_lib import comm
    from ddp_lib.kit.data import shard_batch
    from ddp_lib.devices import comm_device
    from ddp_lib.fsdp import FSDP
    from ddp_lib.torch_fsdp.dcp import gather_full
    from ddp_lib.kit.models import Block, TransformerLM, lm_loss

    rank, ws, dev = dist.get_rank(), dist.get_world_size(), comm_device()
    torch.manual_seed(seed)
    base = TransformerLM(preset)
    theirs, apart = copy.deepcopy(base), copy.deepcopy(base)
    for t in list(theirs.state_dict().values()) + list(apart.state_dict().values()):  # rank 0's init, as FSDP does
        buf = t.detach().to(dev)
        comm.broadcast(buf, 0)
        t.copy_(buf)
    ours = FSDP(base.to(dev), units=(Block,))
    mesh = init_device_mesh(dev.type, (ws,))
    shard_grouped(theirs.to(dev), mesh, (Block,))
    g = torch.Generator().manual_seed(seed + 1)
    cfg = base.cfg
    batches = [torch.randint(0, cfg.vocab_size, (batch * ws, cfg.context_length // 4), generator=g, device="cpu")
               for _ in range(steps)]  # drawn on the CPU generator, the same on every device; moved per step
    out: dict = {"ours": [], "fully_shard": []}
    for model, key in ((ours, "ours"), (theirs, "fully_shard")):
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        for tokens in batches:
            opt.zero_grad()
            loss = lm_loss(model, shard_batch(tokens, rank, ws).to(dev))
            loss.backward()
            opt.step()
            out[key].append(loss.item())
    full_ours = ours.gather_full_params()
    full_theirs = {n: gather_full(p) for n, p in theirs.named_parameters()}
    out["max_param_diff"] = max((full_ours[n].cpu() - full_theirs[n].cpu()).abs().max().item() for n in full_ours)
    out["tied"] = {"ours": ours.module.tok.weight is ours.module.lm_head.weight,
                   "fully_shard": theirs.tok.weight is theirs.lm_head.weight}
    shard_grouped(apart.to(dev), mesh, (Block,), group_tied=False)
    try:
        lm_loss(apart, batches[0][:1].to(dev))
        out["apart_error"] = None
    except ValueError as e:  # fully_shard's lazy init, on every rank alike: no collective is left waiting
        out["apart_error"] = str(e)
    return out
