"""How much of the gradient bytes each engine had reduced when backward's compute ended: the race's `hidden` column.

Per variant, a few training steps with `torch.distributed.all_reduce` spied on: every asynchronous all-reduce
issued during backward is recorded with its size, and the moment the engine starts its synchronization (at the end
of backward for OverlapDDP/BucketedDDP, whose end-of-backward callback then waits; in `finish` for the others; on a
GPU, once the compute stream is done) each one is asked whether it has completed. The share of the gradient bytes already reduced then
is what overlapping bought, measured directly: it does not depend on how much slower backward got, nor on the wait
for a slower rank. Engines that communicate only after backward (naive, flat) get 0 by construction; torch DDP's
C++ reducer is not visible to the spy (None).
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ddp_lib.bench.ddp_step import engine_name, seeded, wrap
from ddp_lib.bench.simlink import SimulatedLink
from ddp_lib.devices import comm_device
from ddp_lib.bench.timing import on_tf32, slowest_rank
from ddp_lib.bench.workloads import get_workload
from ddp_lib.contract import DataParallelWrapper
from ddp_lib.ddp import ENGINES
from ddp_lib.launch import run_on_ranks


@on_tf32  # the race's compute speed (ddp_step.ddp_rank_bench): the share hidden depends on it
def reduced_by_backward_end(model: str = "mlp", variants: list[str] | None = None, bucket_mb: float | None = None,
                            steps: int = 3, warmup: int = 1, batch_size: int | None = None,
                            seed: int = 0, link: tuple[float, float] | None = None) -> dict[str, float | None]:
    """On the current group: per variant, the median over steps of the share of gradient bytes reduced by the end
    of backward (the smallest share over ranks); None for variants the spy cannot see (torch DDP).
    `link`: (alpha_us, bandwidth_GBps) of a SimulatedLink to probe under."""
    if link is not None:
        with SimulatedLink(*link):
            return reduced_by_backward_end(model, variants, bucket_mb, steps, warmup, batch_size, seed)
    device, ws = comm_device(), dist.get_world_size()
    workload = get_workload(model)
    bucket_mb = workload.bucket_mb if bucket_mb is None else bucket_mb
    n = batch_size or workload.default_batch
    n = -(-n // ws) * ws
    full = workload.batch(torch.Generator().manual_seed(seed + 1), n)
    batch = tuple(t.chunk(ws)[dist.get_rank()].to(device) for t in full)
    real = dist.all_reduce
    shares: dict[str, float | None] = {}
    for variant in variants or ["naive", "flat", "overlap", "bucketed"]:
        engine = ENGINES.get(engine_name(variant))
        if engine is None or not issubclass(engine, DataParallelWrapper):  # the probe times the front's _synchronize
            shares[variant] = None
            continue
        module = seeded(workload, seed, device)  # the race's model, built anew: no original kept beside it
        grad_bytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        ddp = wrap(variant, module, bucket_mb, device, workload.first_bucket_mb)[0]  # the race's own constructor
        done_shares = []
        for i in range(warmup + steps):
            issued: list[tuple[int, dist.Work]] = []

            def spy(tensor, *args, **kwargs):
                work = real(tensor, *args, **kwargs)
                if kwargs.get("async_op"):
                    issued.append((tensor.numel() * tensor.element_size(), work))
                return work

            marks: list[int] = []

            def probed_synchronize(original=type(ddp)._synchronize.__get__(ddp)) -> None:
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()  # backward's kernels, not NCCL's stream
                marks.append(sum(nbytes for nbytes, work in issued if work.is_completed()))
                return original()

            module.zero_grad(set_to_none=False)
            ddp._synchronize = probed_synchronize  # runs before the engine launches the rest and waits
            dist.all_reduce = spy
            try:
                workload.loss(ddp, batch).backward()
                ddp.finish_gradient_synchronization()
            finally:
                dist.all_reduce = real
                del ddp._synchronize
            if i >= warmup:
                done_shares.append(marks[0] / grad_bytes)
        worst = [-v for v in slowest_rank([-s for s in done_shares], device)]  # per step, the smallest over ranks
        shares[variant] = statistics.median(worst)
        del ddp, module
    return shares


def run_overlap_probe(model: str = "mlp", variants: list[str] | None = None, world_size: int = 2,
                      backend: str | None = None, timeout_s: float = 900.0, **kwargs) -> dict[str, float | None]:
    """reduced_by_backward_end on the current process group, or on spawned local ranks."""
    kwargs.update(model=model, variants=variants)
    return run_on_ranks(reduced_by_backward_end, world_size, kwargs=kwargs, backend=backend, timeout_s=timeout_s,
                        threads=1)
