"""The FSDP race: the course's `FSDP` against torch's `fully_shard` (FSDP2), the same model, data and optimizer.

An MLP of `depth` Linear layers (ReLU between), one unit per Linear on both sides (the course's
`FSDP(model, units=(nn.Linear,))`: weight and bias gathered together, as `fully_shard` on each Linear does, then
on the root). Each variant is built afresh per round and trained `warmup + steps` steps; a step is timed from a
barrier to the end of `optimizer.step()` (the device drained first), the slowest rank's time counts. Rounds
rotate the order (round r starts with variant r mod 2), so a machine whose load drifts slows both alike; the
ratio is the course's median step over torch's. Both must end with the same parameters (checked, atol 1e-5).

    python -m ddp_lib.bench.fsdp_race [--rounds 3] [--steps 10] [--depth 8] [--width 256]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib.bench.race import median_interval
from ddp_lib.bench.timing import median, slowest_rank, start_clock, stop_clock
from ddp_lib.compat import fsdp2
from ddp_lib.kit.data import shard_batch
from ddp_lib.devices import comm_device
from ddp_lib.fsdp import FSDP
from ddp_lib.launch import spawn

VARIANTS = ("course", "torch")


def mlp(width: int, depth: int) -> nn.Sequential:
    """`depth` Linear(width, width) layers with ReLU between, seeded: every variant starts from the same weights."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(width, width)] + ([nn.ReLU()] if i < depth - 1 else [])
    return nn.Sequential(*layers)


def build(variant: str, width: int, depth: int, device: torch.device) -> nn.Module:
    """The model wrapped by `variant`: the course's FSDP, or fully_shard on each Linear and then the root."""
    model = mlp(width, depth).to(device)
    if variant == "course":
        return FSDP(model, units=(nn.Linear,))
    fully_shard, _ = fsdp2()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for m in [m for m in model if isinstance(m, nn.Linear)] + [model]:
        fully_shard(m, mesh=mesh)
    return model


def full_params(variant: str, engine: nn.Module) -> torch.Tensor:
    """Every parameter, whole, flattened into one CPU tensor (a collective)."""
    if variant == "course":
        return torch.cat([t.detach().reshape(-1).cpu() for t in engine.gather_full_params().values()])
    return torch.cat([p.full_tensor().detach().reshape(-1).cpu() for p in engine.parameters()])


def run_variant(variant: str, batches: list, warmup: int, steps: int, width: int, depth: int,
                device: torch.device) -> tuple[list[float], torch.Tensor]:
    """Train `variant` for warmup + steps steps; (the slowest rank's timed step seconds, final full parameters)."""
    engine = build(variant, width, depth, device)
    opt = torch.optim.SGD(engine.parameters(), lr=1e-2)
    times = []
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        t0 = start_clock(device)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(engine(x), y).backward()
        if variant == "course":
            engine.finish_gradient_synchronization()  # only confirms: it synchronized when backward ended
        opt.step()
        dt = stop_clock(device, t0)
        if i >= warmup:
            times.append(dt)
    return slowest_rank(times, device), full_params(variant, engine)


def fsdp_rank_race(rounds: int = 3, steps: int = 10, warmup: int = 3, width: int = 256, depth: int = 8,
                   batch_size: int = 64) -> dict:
    """On the current process group: the race; {variant: {step_ms, p25_ms, p75_ms}, ratio, same_params, ...}."""
    device, rank, ws = comm_device(), dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    def draw() -> torch.Tensor:  # this rank's shard of a batch drawn alike on every rank, on the comm device
        return shard_batch(torch.randn(batch_size, width, generator=gen, device="cpu"), rank, ws).to(device)

    batches = [(draw(), draw()) for _ in range(4)]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    round_ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
    finals: dict[str, torch.Tensor] = {}
    for r in range(rounds):
        for k in range(len(VARIANTS)):
            variant = VARIANTS[(r + k) % len(VARIANTS)]
            got, finals[variant] = run_variant(variant, batches, warmup, steps, width, depth, device)
            times[variant] += got
            round_ms[variant].append(median(got) * 1e3)
    out: dict = {"rounds": rounds, "steps": steps * rounds, "world_size": ws, "backend": dist.get_backend(),
                 "width": width, "depth": depth, "batch_size": batch_size}
    for v, ts in times.items():
        q = torch.tensor(ts, dtype=torch.float64, device="cpu").quantile(  # host-side statistics, no collective
            torch.tensor([0.25, 0.75], dtype=torch.float64, device="cpu")).tolist()
        out[v] = {"step_ms": median(ts) * 1e3, "p25_ms": q[0] * 1e3, "p75_ms": q[1] * 1e3}
    out["ratio"] = out["course"]["step_ms"] / out["torch"]["step_ms"]
    out["round_ratios"] = [c / t for c, t in zip(round_ms["course"], round_ms["torch"])]
    out["param_diff"] = (finals["course"] - finals["torch"]).abs().max().item()
    return out


def format_race(res: dict) -> str:
    """The race as a few lines of text, its conclusion computed from the numbers."""
    lines = [f"FSDP race: {res['depth']}-layer MLP (width {res['width']}), one unit per Linear, "
             f"{res['world_size']} {res['backend']} ranks, {res['steps']} timed steps per variant over "
             f"{res['rounds']} rotated rounds"]
    for v in VARIANTS:
        r = res[v]
        lines.append(f"  {v:>6}  median step {r['step_ms']:8.2f} ms  (IQR {r['p25_ms']:.2f}-{r['p75_ms']:.2f})")
    verdict = "at or below" if res["ratio"] <= 1.0 else "above"
    lines.append(f"  course / torch = {res['ratio']:.2f}: the course's FSDP is {verdict} fully_shard's step; "
                 f"final parameters differ by at most {res['param_diff']:.1e}")
    ratios = res.get("round_ratios") or []
    if len(ratios) >= 5:  # rounds pair the two variants in time: the interval is of the per-round ratio's median
        lo, hi = median_interval(ratios)
        where = ("lies at or below" if hi <= 1.0 else "includes") if lo <= 1.0 else "lies above"
        lines.append(f"  per round: {' '.join(f'{x:.3f}' for x in ratios)}; median {statistics.median(ratios):.3f}, "
                     f"90% bootstrap interval {lo:.3f}-{hi:.3f}: {where} 1.00")
    return "\n".join(lines)


def run_fsdp_race(world_size: int = 2, **kwargs) -> dict:
    """Spawn `world_size` gloo ranks and run the race; rank 0's result."""
    return spawn(fsdp_rank_race, world_size, kwargs=kwargs, backend="gloo", timeout_s=1800)[0]


def main(argv: list[str] | None = None) -> dict:
    """The command line: run the race on spawned ranks and print it."""
    p = argparse.ArgumentParser(prog="python -m ddp_lib.bench.fsdp_race", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (split across ranks)")
    p.add_argument("--world-size", type=int, default=2)
    a = p.parse_args(argv)
    res = run_fsdp_race(a.world_size, rounds=a.rounds, steps=a.steps, warmup=a.warmup, width=a.width,
                        depth=a.depth, batch_size=a.batch_size)
    print(format_race(res))
    return res


if __name__ == "__main__":
    main()
