"""DDP step benchmark: NaiveDDP, FlatDDP, OverlapDDP, BucketedDDP and torch DDP race on one model, data and seed.

Every variant starts from the same seeded model, built anew on the device for it (`seeded`: no original is kept
alive beside the variant), sees the same global batches (each rank its slice) and trains `warmup + steps` SGD steps
(zero_grad(set_to_none=False), forward, backward, finish_gradient_synchronization, optimizer.step). One variant at a
time is built, warmed up (untimed), timed, measured and freed (del; gc.collect if a cycle kept it;
torch.cuda.empty_cache), so one variant's model is alive at a time, beside the reference's final parameters on the
same device (no host copy of the model: lm-xl's race runs on a GPU box whatever its host memory).
With `rounds` > 1 the whole sequence repeats, each round starting one variant later, so a machine whose
load drifts (a laptop, a shared 2-core box) slows every variant alike. With `interleave` every variant is built
at once and they take one step each in turn (the turn reversed every step): each step is a round of one, the pairing
closest in time, at the price of every model copy alive together (no peak memory then). Each timed quantity is maxed
over ranks per step (the slowest rank decides) and the median over all timed steps is reported.

Columns (milliseconds unless said otherwise):
  step_ms / min_step_ms  whole step between a barrier and the end of optimizer.step: median / fastest;
  p25_step_ms, p75_step_ms  its quartiles (the spread the race table shows as IQR)
  fwd_ms, bwd_ms         forward+loss; loss.backward(). For overlap, bucketed and torch DDP bwd_ms includes the
                         end-of-backward wait: their autograd callback launches what is still pending and waits for
                         every all-reduce before backward returns (so bwd_ms - nocomm's bwd_ms mixes what backward
                         lost to the communication beside it with the communication left when its compute ended)
  finish_ms              time inside finish_gradient_synchronization() (None for torch DDP: it has none). For naive
                         and flat it is all their communication; for overlap and bucketed it only confirms (~0)
  exposed_comm_ms        step_ms - step_ms of "nocomm" (the same model trained locally, no sync at all): what
                         synchronizing costs the step, whatever the cause
  comm_ms                naive, flat: finish_ms; overlap, bucketed, torch DDP (which wait inside backward):
                         exposed_comm_ms
  total_comm_ms          the variant's own messages (per-param, flat, or its buckets), all-reduced
                         back to back with nothing else running: what communication costs un-hidden
  (the race's `hidden` column, race.hidden_share, comes from overlap_probe: the share of gradient bytes reduced
                         when backward's compute ended, measured directly)
  comm_calls             all-reduce calls per synchronized step (torch DDP: its buckets, seen by a comm hook)
  peak_mem_mb            memory the variant adds at its peak (model copy, grads, comm buffers, step transients)
                         over what was allocated before it was built, from construction to its last timed
                         step: CUDA max_memory_allocated after reset_peak_memory_stats, or on CPU the rank's
                         peak RSS (Linux VmHWM) minus its RSS before; the maximum over rounds
  param_diff             max |final parameter - reference variant's| and - rank 0's, over ranks, first round (<= 1e-5
                         in fp32), compared piece by piece on the device (`check_final`)
  round_step_ms          per round, the median of its timed steps (slowest rank): two variants' ratio round by
                         round compares steps of one round, so drift from round to round cancels (within one still counts)
Variants: naive, flat, overlap, simple, bucketed[:MB], torch[:MB] (torch DDP, default flags),
torch-view[:MB] (gradient_as_bucket_view=True, the same persistent-view trick BucketedDDP uses).
torch DDP gets BucketedDDP's plan: `bucket_cap_mb_list=[first, cap]` (the workload's first-bucket cap, by default
torch's 1 MiB, then the cap) where torch has that argument; otherwise bucket_cap_mb=None at 25 MB (its default, which
has the 1 MiB first bucket) or the cap.
`link=(alpha_us, bandwidth_GBps)` runs the whole race under a `simlink.SimulatedLink` (torch DDP through a
comm hook that calls dist.all_reduce, so it sees the link too); `bucket_mb=None`: the workload's cap.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import statistics
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ddp_lib.bench.allreduce import allreduce_rank_bench
from ddp_lib.bench.alphabeta import best_bucket_bytes, exposed_comm_s, fit_alpha_beta
from ddp_lib.bench.simlink import SimulatedLink, link_comm_hook
from ddp_lib.devices import comm_device
from ddp_lib.bench.throughput import device_peak, step_work
from ddp_lib.bench.timing import (StepClock, current_memory_mb, free_memory, median, on_tf32, peak_memory_mb,
                                  progress, reset_peak_memory, slowest_rank, start_clock, stop_clock)
from ddp_lib.bench.workloads import get_workload
from ddp_lib.ddp import ENGINES, BucketedDDP, OverlapDDP
from ddp_lib import comm
from ddp_lib.comm import group_by_kind
from ddp_lib.ddp.bucketed import FIRST_BUCKET_MB
from ddp_lib.launch import run_on_ranks

DEFAULT_VARIANTS = ["naive", "flat", "overlap", "bucketed", "torch-view"]
MB = 2**20
TORCH_DEFAULT_CAP_MB = 25.0
Message = tuple[int, torch.dtype]  # one all-reduce: (elements, dtype)


def engine_name(variant: str) -> str:
    """The `ENGINES` name a race variant builds, else its kind: "bucketed-pergrad" is BucketedDDP hooked per gradient
    at every step (`hook_per_bucket=False`)."""
    kind = variant.partition(":")[0]
    return "bucketed" if kind == "bucketed-pergrad" else kind


def wrap(variant: str, model: nn.Module, bucket_mb: float, device: torch.device, first_mb: float | None = None):
    """(module to call, finish-sync callable or None, bucket MB or None) for a variant name; `first_mb`: the first
    bucket's cap for bucketed and torch DDP (None: torch's 1 MiB)."""
    kind, _, arg = variant.partition(":")
    mb = float(arg) if arg else bucket_mb
    first = FIRST_BUCKET_MB if first_mb is None else first_mb
    if kind == "nocomm":
        return model, None, None
    if engine_name(kind) == "bucketed":
        ddp = ENGINES["bucketed"](model, bucket_size_mb=mb, first_bucket_mb=first,
                                  hook_per_bucket=kind == "bucketed")
        return ddp, ddp.finish_gradient_synchronization, mb
    if kind in ENGINES:
        ddp = ENGINES[kind](model)
        return ddp, ddp.finish_gradient_synchronization, None
    if kind in ("torch", "torch-view"):
        ids = [device] if device.type == "cuda" else None
        caps = dict(bucket_cap_mb=None if mb == TORCH_DEFAULT_CAP_MB else mb)  # None: its default, 1 MiB first bucket
        if mb > first and "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel).parameters:
            caps = dict(bucket_cap_mb_list=[first, mb])  # BucketedDDP's plan at any cap (torch >= 2.10)
        ddp = DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=kind == "torch-view",
                                      **caps)
        if SimulatedLink.active is not None:  # its C++ reducer bypasses dist.all_reduce: a hook routes it through
            ddp._seen_buckets = seen = []

            def linked(state, bucket):
                seen.append((bucket.buffer().numel(), bucket.buffer().dtype))
                return link_comm_hook(state, bucket)

            ddp.register_comm_hook(None, linked)
        return ddp, None, mb
    raise ValueError(f"unknown variant {variant!r}: nocomm, {', '.join(ENGINES)}, bucketed[:<MB>], "
                     "bucketed-pergrad[:<MB>], torch[:<MB>], torch-view[:<MB>]")


def time_messages(msgs: list[Message], device: torch.device, reps: int = 5) -> float:
    """Median (over reps) slowest-rank seconds to all-reduce these messages back to back, blocking."""
    if not msgs:
        return 0.0
    bufs = {dtype: torch.zeros(max(n for n, d in msgs if d == dtype), dtype=dtype, device=device)
            for dtype in {d for _, d in msgs}}  # one buffer per gradient dtype: the real element size
    times = []
    for i in range(reps + 1):
        t0 = start_clock(device)
        for n, dtype in msgs:
            comm.all_reduce(bufs[dtype][:n])
        if i:  # the first round is a warm-up
            times.append(stop_clock(device, t0))
    return median(slowest_rank(times, device))


def _shard(batch: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    return tuple(t.chunk(ws)[rank].to(device) for t in batch)


def seeded(workload, seed: int, device: torch.device) -> nn.Module:
    """`workload`'s model built on `device` from `seed`: the same model at every call, so each variant builds its own
    and no seeded original (on a GPU: a whole model's memory) stays alive beside it; nothing passes through the host."""
    torch.manual_seed(seed)
    with torch.device(device):
        return workload.build()


class VariantRun:
    """One variant's model, wrapper and optimizer, stepped and timed one step at a time."""

    def __init__(self, variant: str, model: nn.Module, workload, bucket_mb: float, lr: float, device: torch.device):
        """`model`: this variant's own (`seeded`), trained in place."""
        self.variant, self.workload, self.device = variant, workload, device
        self.model = model
        self.wrapped, self.finish, self.bucket_mb = wrap(variant, self.model, bucket_mb, device,
                                                         workload.first_bucket_mb)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        self.times: list[list[float]] = []  # per timed step: total, forward, backward, finish (this rank)

    def weakrefs(self) -> list[weakref.ref]:
        """Weak references to this run and what holds its memory (model, wrapper, optimizer): `free_memory` collects
        only if one of them outlives the run."""
        return [weakref.ref(x) for x in (self, self.model, self.wrapped, self.opt)]

    def step(self, batch: tuple[torch.Tensor, ...], timed: bool = True) -> None:
        """One training step between a barrier and a device sync; its timings are kept if `timed`."""
        clock = StepClock(self.device)
        t0 = start_clock(self.device)
        clock.mark()
        self.opt.zero_grad(set_to_none=False)
        loss = self.workload.loss(self.wrapped, batch)
        clock.mark()
        loss.backward()
        clock.mark()
        if self.finish is not None:
            self.finish()
        clock.mark()
        self.opt.step()
        total = stop_clock(self.device, t0)
        if timed:
            self.times.append([total, *clock.intervals_s()])

    def messages(self, batch: tuple[torch.Tensor, ...]) -> list[Message]:
        """The all-reduces one synchronized step issues. Torch DDP's buckets are seen by a recording comm
        hook (public API) on one extra step: call this after the final parameters were read."""
        kind = self.variant.partition(":")[0]
        grads = [p for p in self.model.parameters() if p.requires_grad]
        if kind == "nocomm":
            return []
        if kind == "flat":
            return [(sum(p.numel() for p in same), same[0].dtype) for same in group_by_kind(grads)]
        if engine_name(kind) == "bucketed":
            return [(b.buffer.numel(), b.buffer.dtype) for b in self.wrapped.buckets]
        if kind.startswith("torch") and hasattr(self.wrapped, "_seen_buckets"):  # the link's hook records them
            self.wrapped._seen_buckets.clear()
            self.step(batch, timed=False)
            return list(self.wrapped._seen_buckets)
        if kind.startswith("torch"):
            seen: list[Message] = []

            def recording_allreduce(state, bucket):  # no annotations: DDP compares them as objects
                seen.append((bucket.buffer().numel(), bucket.buffer().dtype))
                return allreduce_hook(state, bucket)  # what DDP does without a hook: average, all-reduce

            self.wrapped.register_comm_hook(None, recording_allreduce)
            self.step(batch, timed=False)
            return seen
        return [(p.numel(), p.dtype) for p in grads]


CHECK_PIECE_BYTES = 64 * MB  # what one comparison of final parameters holds at a time, beside the model


def param_pieces(model: nn.Module) -> Iterator[torch.Tensor]:
    """`model`'s parameters flattened to fp32, in pieces of about CHECK_PIECE_BYTES (whole parameters), on their
    device: a check holds one piece at a time, never a flat copy of the whole model."""
    piece, size = [], 0
    for p in model.parameters():
        piece.append(p.detach().reshape(-1).float())
        size += p.numel() * 4
        if size >= CHECK_PIECE_BYTES:
            yield torch.cat(piece)
            piece, size = [], 0
    if piece:
        yield torch.cat(piece)


def check_final(model: nn.Module, device: torch.device, reference: list[torch.Tensor] | None
                ) -> tuple[float, list[torch.Tensor] | None]:
    """(max |final parameter - rank 0's| and, given `reference`, - the reference's, the largest over ranks; the
    pieces to keep as the reference when none was given). One piece at a time on the device: the reference is one
    fp32 copy of the model there, and the host holds none."""
    worst = torch.zeros((), device=device)
    kept: list[torch.Tensor] = []
    for k, mine in enumerate(param_pieces(model)):
        rank0 = mine.clone()
        comm.broadcast(rank0, src=0)  # all ranks must hold rank 0's parameters, too
        worst = torch.maximum(worst, (mine - rank0).abs().max())
        del rank0
        if reference is None:
            kept.append(mine)
        else:
            worst = torch.maximum(worst, (mine - reference[k]).abs().max())
    return max(slowest_rank([worst.item()], device)), (kept if reference is None else None)


ALLOCATOR_WARMUP_STEPS = 2


def warm_up_allocator(order: list[str], build: Callable[[], nn.Module], workload, batches: list, bucket_mb: float,
                      lr: float, device: torch.device, bar) -> None:
    """Build, step twice and free every variant once, untimed, before the race.

    glibc raises its mmap and trim thresholds only once large blocks have been freed, and never lowers them:
    in a fresh rank process the first variant to allocate large gradient buffers pays thousands of page faults
    per step that every later variant is spared (measured: about 2,500 per backward against 41, about 10 % of
    the step). One pass over all variants puts them on the same footing whatever their order.
    """
    for variant in order:
        bar.set_postfix_str(f"{variant} (allocator warm-up)")
        run = VariantRun(variant, build(), workload, bucket_mb, lr, device)
        for i in range(ALLOCATOR_WARMUP_STEPS):
            run.step(batches[i % len(batches)], timed=False)
            bar.update()
        dropped = run.weakrefs()
        del run
        free_memory(device, dropped)


def _race_one(variant: str, build: Callable[[], nn.Module], workload, batches: list, warmup: int, steps: int,
              bucket_mb: float, lr: float, device: torch.device, bar, check: bool,
              reference: list[torch.Tensor] | None) -> dict:
    """Build, warm up, time and measure one variant (`check`: its final parameters against the reference
    and across ranks); all it allocated is garbage when this returns."""
    before = current_memory_mb(device)
    reset_peak_memory(device)
    run = VariantRun(variant, build(), workload, bucket_mb, lr, device)
    for i in range(warmup + steps):
        run.step(batches[i % len(batches)], timed=i >= warmup)
        bar.update()
    peak = max(slowest_rank([peak_memory_mb(device) - before], device))
    return dict(times=run.times, peak=peak, round_sizes=[len(run.times)], **_measured(run, batches, device, check,
                                                                                       reference))


def _race_interleaved(order: list[str], build: Callable[[], nn.Module], workload, batches: list, warmup: int, steps: int,
                      bucket_mb: float, lr: float, device: torch.device, bar) -> dict[str, dict]:
    """Every variant built at once and stepped in turn, the turn reversed every step: step i of two variants ran side
    by side in time, so each step is a round of one (`round_step_ms`) and the machine's drift cancels step by step.
    All model copies are alive together (not for a model that fills the device), so no peak memory is measured."""
    runs = [VariantRun(v, build(), workload, bucket_mb, lr, device) for v in order]
    for i in range(warmup + steps):
        for run in runs if i % 2 == 0 else runs[::-1]:
            run.step(batches[i % len(batches)], timed=i >= warmup)
            bar.update()
    res: dict[str, dict] = {}
    reference = None
    for run in runs:
        one = dict(times=run.times, peak=None, round_sizes=[1] * len(run.times),
                   **_measured(run, batches, device, True, reference))
        final = one.pop("final", None)
        reference = final if final is not None else reference
        res[run.variant] = one
    return res


def _measured(run: VariantRun, batches: list, device: torch.device, check: bool,
              reference: list[torch.Tensor] | None) -> dict:
    """What a variant reports besides its times, once they are taken: its final parameters checked (`check`: against
    the reference, the first variant checked, and across ranks), its messages and calls, weak references to free."""
    out = dict(bucket_mb=run.bucket_mb, has_finish=run.finish is not None,
               waits_in_backward=isinstance(run.wrapped, (OverlapDDP, BucketedDDP)),
               grad_bytes=sum(p.numel() * p.element_size() for p in run.model.parameters() if p.requires_grad))
    if check and run.variant != "nocomm":  # the first variant checked is the reference
        out["param_diff"], out["final"] = check_final(run.model, device, reference)
    out["msgs"] = run.messages(batches[0])  # after final_params: torch DDP takes one more step here
    out["comm_calls"] = run.wrapped.comm_calls if run.finish is not None else len(out["msgs"])
    out["dropped"] = run.weakrefs()  # for the caller's free_memory, once this frame (and `run`) is gone
    return out


@on_tf32  # on GPUs fp32 matmuls on TF32 tensor cores, as fp32 training there runs: a realistic compute/comm balance
def ddp_rank_bench(model: str = "mlp", variants: list[str] | None = None, bucket_mb: float | None = None,
                   steps: int = 20, warmup: int = 5, batch_size: int | None = None, seed: int = 0,
                   lr: float = 1e-3, predict: bool = False, rounds: int = 1,
                   link: tuple[float, float] | None = None, allocator_warmup: bool = True,
                   interleave: bool = False) -> list[dict]:
    """On the current process group: race `variants` (plus a "nocomm" baseline) and return one row each
    (`link`: (alpha_us, bandwidth_GBps) of a simulated link the whole race runs on; `allocator_warmup=False`
    skips `warm_up_allocator` in a process where an earlier race already ran it: glibc's thresholds stay raised;
    `interleave`: all variants at once, one step each in turn (`_race_interleaved`), in place of `rounds`). Every row
    also holds what a step works on and this rank's peak (`throughput.step_work`, `device_peak`)."""
    if interleave and rounds != 1:
        raise ValueError("interleave steps the variants in turn, each step a round: leave rounds at 1")
    if link is not None:
        with SimulatedLink(*link) as sim:
            rows = ddp_rank_bench(model, variants, bucket_mb, steps, warmup, batch_size, seed, lr, predict, rounds,
                                  allocator_warmup=allocator_warmup, interleave=interleave)
        for r in rows:
            r.update(link=sim.label, link_alpha_us=link[0], link_GBps=link[1])
        return rows
    device, ws = comm_device(), dist.get_world_size()
    order = ["nocomm"] + list(variants or DEFAULT_VARIANTS)
    workload = get_workload(model)
    bucket_mb = workload.bucket_mb if bucket_mb is None else bucket_mb
    build = functools.partial(seeded, workload, seed, device)
    gen = torch.Generator().manual_seed(seed + 1)
    n = batch_size or workload.default_batch
    n = -(-n // ws) * ws  # every rank gets an equal slice
    batches = [_shard(workload.batch(gen, n), device) for _ in range(min(steps + warmup, 4))]
    peak, peak_what = device_peak(device)
    with torch.device("meta"):  # the model's shapes, for what a step works on: no copy of it kept anywhere
        shapes = workload.build()
    work = dict(step_work(workload, shapes, batches[0], ws), peak_flops=peak, peak_what=peak_what)
    del shapes
    warm_steps = len(order) * ALLOCATOR_WARMUP_STEPS if allocator_warmup else 0
    bar = progress(rounds * len(order) * (steps + warmup) + warm_steps, f"ddp {model} x{ws}")
    free_memory(device)  # what earlier work left in reference cycles goes before the first measurement
    if allocator_warmup:
        warm_up_allocator(order, build, workload, batches, bucket_mb, lr, device, bar)
    res: dict[str, dict] = {}
    reference = None  # the first variant's final parameters (pieces, on the device): every other must match them
    if interleave:
        res = _race_interleaved(order, build, workload, batches, warmup, steps, bucket_mb, lr, device, bar)
        free_memory(device, [ref for one in res.values() for ref in one.pop("dropped")])
    for r in range(0 if interleave else rounds):
        for k in range(len(order)):
            variant = order[(r + k) % len(order)]  # round 0 in the given order: its first variant is the reference
            bar.set_postfix_str(f"{variant} (round {r + 1}/{rounds})")
            one = _race_one(variant, build, workload, batches, warmup, steps, bucket_mb, lr, device, bar,
                            check=r == 0, reference=reference)
            # the variant's model copy, grads, buckets and optimizer go before the next is built
            free_memory(device, one.pop("dropped"))
            final = one.pop("final", None)
            reference = final if final is not None else reference
            if variant in res:  # later rounds: more timed steps (one more round of them), the higher peak
                res[variant]["times"] += one["times"]
                res[variant]["round_sizes"] += one["round_sizes"]
                res[variant]["peak"] = max(res[variant]["peak"], one["peak"])
            else:
                res[variant] = one
    bar.close()
    rows = [_row(v, res[v], device) for v in order]
    grad_bytes = res[order[0]]["grad_bytes"]
    nocomm = rows[0]
    for r in rows:
        r.update(model=model, world_size=ws, backend=dist.get_backend(), batch_size=n, steps=steps * rounds,
                 grad_mb=grad_bytes / MB, **work)
        r["exposed_comm_ms"] = max(0.0, r["step_ms"] - nocomm["step_ms"])
        # hook engines wait at the end of backward: their finish only confirms, so it is not their communication
        in_finish = r["finish_ms"] is not None and not res[r["variant"]]["waits_in_backward"]
        r["comm_ms"] = r["finish_ms"] if in_finish else r["exposed_comm_ms"]
    if predict:
        add_prediction(rows, grad_bytes, nocomm["bwd_ms"] / 1e3, device)
    return rows


def quartiles(xs: list[float]) -> tuple[float, float]:
    """First and third quartiles (inclusive method: within the data's range; one value: itself twice)."""
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _row(variant: str, one: dict, device: torch.device) -> dict:
    """Medians over timed steps of the slowest rank's times, comm calls, un-hidden comm cost, peak memory."""
    cols = list(zip(*[slowest_rank(t, device) for t in one["times"]]))
    q1, q3 = quartiles(cols[0])
    ends = list(itertools.accumulate(one["round_sizes"]))  # each round's timed steps, in the order they ran
    rounds = [median(cols[0][end - n:end]) * 1e3 for n, end in zip(one["round_sizes"], ends) if n]
    return dict(variant=variant, bucket_mb=one["bucket_mb"], step_ms=median(cols[0]) * 1e3,
                min_step_ms=min(cols[0]) * 1e3, p25_step_ms=q1 * 1e3, p75_step_ms=q3 * 1e3, fwd_ms=median(cols[1]) * 1e3, bwd_ms=median(cols[2]) * 1e3,
                finish_ms=median(cols[3]) * 1e3 if one["has_finish"] else None, comm_calls=one["comm_calls"],
                total_comm_ms=time_messages(one["msgs"], device) * 1e3, peak_mem_mb=one["peak"],
                param_diff=one.get("param_diff"), round_step_ms=rounds)


def add_prediction(rows: list[dict], grad_bytes: int, backward_s: float, device: torch.device) -> None:
    """Fit α–β on this group (sizes 4 KiB .. the gradient size) and add the model's view to every row."""
    sizes, s = [], 4096
    while s < grad_bytes:
        sizes.append(s)
        s *= 4
    fit = fit_alpha_beta(allreduce_rank_bench(sizes + [grad_bytes], iters=10, warmup=2, budget_s=2.0))
    best = best_bucket_bytes(fit, grad_bytes, backward_s)
    for r in rows:
        r.update(alpha_us=fit.alpha_us, bandwidth_GBps=fit.bandwidth_GBps, predicted_best_bucket_mb=best / MB)
        if r["variant"].startswith("bucketed"):
            r["predicted_exposed_ms"] = exposed_comm_s(r["bucket_mb"] * MB, fit, grad_bytes, backward_s) * 1e3


def run_ddp_bench(model: str = "mlp", variants: list[str] | None = None, world_size: int = 2,
                  backend: str | None = None, timeout_s: float = 1800.0, **kwargs) -> list[dict]:
    """Rows of ddp_rank_bench: on the current process group (torchrun, notebook) or on spawned local ranks."""
    kwargs.update(model=model, variants=variants)
    return run_on_ranks(ddp_rank_bench, world_size, kwargs=kwargs, backend=backend, timeout_s=timeout_s, threads=1)
