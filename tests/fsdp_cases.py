"""Rank-side code of the FSDP tests: trains, counts collectives, returns what the parent compares."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib import comm
from ddp_lib.kit.data import shard_batch
from ddp_lib.fsdp import FSDP
from ddp_lib.kit.models import FrozenModel, ToyModel, TransformerLM, UnusedBranchModel

STEPS = 3
LR = 0.05


def lm_batch(step: int, ws: int) -> torch.Tensor:
    """The global token batch of `step` (divisible by ws; the same in every process)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 512, (4 * ws, 17), generator=g)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def mixed(model: nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The mixed-precision recipe on a plain model: weights cast to `dtype` for forward and backward, fp32 masters."""
    if dtype is None:
        return model(x)
    # a tied weight is cast once per use (as FSDP gathers it once per use): its two gradients meet in fp32
    params = {n: p.to(dtype) for n, p in model.named_parameters(remove_duplicate=False)}
    x = x.to(dtype) if x.is_floating_point() else x
    return torch.func.functional_call(model, params, (x,), tie_weights=False)


def train_reference(ws: int, dtype: torch.dtype | None) -> tuple[list[dict], list[float]]:
    """Single process, full batch, same recipe: parameters after each step, and each step's loss."""
    torch.manual_seed(0)
    model = TransformerLM("tiny")
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    params, losses = [], []
    for step in range(STEPS):
        tokens = lm_batch(step, ws)
        loss = lm_loss(mixed(model, tokens, dtype), tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params, losses


def shard_of(full: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    """This rank's slice of a tensor flattened and zero-padded to a multiple of ws (FSDP's layout)."""
    flat = full.detach().reshape(-1).float()
    flat = F.pad(flat, (0, -flat.numel() % ws))
    return flat.chunk(ws)[rank]


def train_lm(dtype: torch.dtype | None) -> dict:
    """FSDP on this rank from a per-rank seed; params after each step (gathered), local losses, first-step checks."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank * 17)  # different on every rank: construction must broadcast rank 0's
    fsdp = FSDP(TransformerLM("tiny"), compute_dtype=dtype)
    opt = torch.optim.SGD(fsdp.parameters(), lr=LR, momentum=0.9)
    out: dict = {"params": [], "losses": [], "shard_numel": sum(p.numel() for p in fsdp.parameters())}
    for step in range(STEPS):
        tokens = shard_batch(lm_batch(step, ws), rank, ws)
        logits = fsdp(tokens)
        loss = lm_loss(logits, tokens)
        opt.zero_grad()
        loss.backward()
        fsdp.finish_gradient_synchronization()
        if step == 0:
            out["logits_dtype"] = logits.dtype
            out["grad_dtypes"] = {p.grad.dtype for p in fsdp.parameters()}
            out["grad_shapes_ok"] = all(p.grad.shape == p.shape for p in fsdp.parameters())
            out.update(first_step_vs_recipe(fsdp, loss, dtype, rank, ws))
        opt.step()
        out["losses"].append(loss.item())
        out["params"].append(fsdp.gather_full_params())
    return out


def first_step_vs_recipe(fsdp: FSDP, loss: torch.Tensor, dtype, rank: int, ws: int) -> dict:
    """The same recipe on a plain model, here on this rank: the local loss, and every rank's local gradient averaged."""
    torch.manual_seed(0)
    plain = TransformerLM("tiny")
    grads: dict[str, torch.Tensor] = {}
    for r in range(ws):
        tokens = shard_batch(lm_batch(0, ws), r, ws)
        plain.zero_grad()
        local = lm_loss(mixed(plain, tokens, dtype), tokens)
        local.backward()
        if r == rank:
            recipe_loss = local.detach()
        for n, p in plain.named_parameters():
            grads[n] = grads.get(n, 0) + p.grad / ws
    shards = {u.shard: u for u in fsdp.units.values()}
    worst = 0.0
    for n, p in fsdp.module.named_parameters():
        want = shard_of(grads[n], rank, ws) if p in shards else grads[n]
        worst = max(worst, ((p.grad - want).abs().max() / want.abs().max()).item())
    return {"loss_vs_recipe": (loss.detach() - recipe_loss).abs().item(), "grad_rel_vs_recipe": worst}


# ---------------------------------------------------------------- an MLP: collectives, prefetch, memory


def mlp_batch(step: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(4 * ws, 32, generator=g), torch.randint(0, 8, (4 * ws,), generator=g)


class CountCollectives:
    """Observes the package's collective layer (ddp_lib.comm): logs each collective's kind, payload bytes and
    which units are gathered at that moment; `torch.distributed` itself is left alone."""

    compares_every_call = False

    def __init__(self, fsdp: FSDP, log: list):
        self.fsdp, self.log = fsdp, log

    def before_collective(self, kind, payload, group, label) -> None:
        self.log.append((kind, payload.numel() * payload.element_size(),
                         [u.name for u in dict.fromkeys(self.fsdp.units.values()) if u.gathered]))


def mlp_steps(accumulate: int) -> dict:
    """ToyModel(depth=3) under FSDP for STEPS steps, `accumulate` backward passes per step; every collective logged."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = ToyModel(depth=3)
    fsdp = FSDP(model)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    log: list = []
    observing = comm.observe(CountCollectives(fsdp, log))
    observing.__enter__()  # left before returning
    order = [model.layers[0], model.layers[1], model.layers[2], model.head]
    prefetched = []  # at each layer's forward (after FSDP's pre-hook), is the next layer's gather under way?
    for m, nxt in zip(order, order[1:]):
        m.register_forward_pre_hook(lambda mod, a, nxt=nxt: prefetched.append(fsdp.units[nxt].gathered))
    steps = []
    for step in range(STEPS):
        x, y = mlp_batch(step, ws)
        x, y = shard_batch(x, rank, ws), shard_batch(y, rank, ws)
        opt.zero_grad()
        log.clear()
        live_after_forward = []
        for m in range(accumulate):
            part = slice(m * len(x) // accumulate, (m + 1) * len(x) // accumulate)
            loss = F.cross_entropy(fsdp(x[part]), y[part]) / accumulate
            live_after_forward.append(len(fsdp._comm.live))
            loss.backward()
        fsdp.finish_gradient_synchronization()
        opt.step()
        steps.append({"log": list(log), "comm_bytes": fsdp.comm_bytes, "comm_calls": fsdp.comm_calls,
                      "live_after_forward": live_after_forward,
                      "live_after_finish": len(fsdp._comm.live)})
    observing.__exit__(None, None, None)
    return {"steps": steps, "prefetched": prefetched, "units": [u.name for u in dict.fromkeys(fsdp.units.values())],
            "params": fsdp.gather_full_params()}


def mlp_reference() -> dict:
    torch.manual_seed(0)
    model = ToyModel(depth=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = mlp_batch(step, 2)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------- unused, frozen, interrupted, errors


def odd_models() -> dict:
    """A layer unused in some steps and one never used; a frozen first layer; a forward that raises."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, make in (("unused", UnusedBranchModel), ("frozen", FrozenModel)):
        torch.manual_seed(rank + 1)
        fsdp = FSDP(make())
        opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = odd_batch(step, ws)
            x, y = shard_batch(x, rank, ws), shard_batch(y, rank, ws)
            kwargs = {"use_sometimes": step % 2 == 1} if name == "unused" else {}
            opt.zero_grad()
            F.cross_entropy(fsdp(x, **kwargs), y).backward()
            fsdp.finish_gradient_synchronization()
            if name == "unused":
                out["unused_grad_zero"] = bool((fsdp.module.unused.weight.grad == 0).all())
            opt.step()
        out[name] = fsdp.gather_full_params()
    torch.manual_seed(0)
    fsdp = FSDP(ToyModel())
    try:
        fsdp(torch.randn(4, 5))  # wrong width: the first layer raises after its gather
    except RuntimeError as err:
        out["raised"] = "shapes cannot be multiplied" in str(err)
    out["restored"] = (all(m._parameters["weight"] is u.shard for m, u in fsdp.units.items())
                       and not fsdp._comm.live)
    fsdp(torch.randn(4, 32)).sum().backward()
    fsdp.finish_gradient_synchronization()
    out["after_error_grads"] = all(p.grad is not None for p in fsdp.parameters())
    return out


def odd_batch(step: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(30 + step)
    return torch.randn(2 * ws, 16, generator=g), torch.randint(0, 4, (2 * ws,), generator=g)


def odd_reference(name: str) -> dict:
    torch.manual_seed(1)
    model = {"unused": UnusedBranchModel, "frozen": FrozenModel}[name]()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for step in range(STEPS):
        x, y = odd_batch(step, 2)
        kwargs = {"use_sometimes": step % 2 == 1} if name == "unused" else {}
        opt.zero_grad()
        F.cross_entropy(model(x, **kwargs), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _SharesWeight(nn.Module):
    """A Linear whose weight the parent also registers (and could use) directly."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.also = self.lin.weight


def construction_errors() -> dict[str, str]:
    """FSDP's message for each module it cannot shard as configured."""
    cases = {
        "no weight": lambda: FSDP(nn.Sequential(nn.LayerNorm(4, elementwise_affine=False)),
                                  shard_types=(nn.LayerNorm,)),
        "shared with a replicated module": lambda: FSDP(_SharesWeight()),
        "sparse embedding": lambda: FSDP(nn.Embedding(10, 4, sparse=True)),
    }
    messages = {}
    for name, build in cases.items():
        try:
            build()
            messages[name] = "no error"
        except ValueError as err:
            messages[name] = str(err)
    return messages
