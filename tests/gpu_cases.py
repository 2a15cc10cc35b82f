"""Rank-side code of the GPU tests: the gloo checks again, each rank on its own GPU under NCCL."""

from __future__ import annotations

import datetime
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_cases import LR, STEPS, make_batch, make_model, state, wrap
from ddp_lib.kit.data import shard_batch
from ddp_lib.devices import comm_device


def _cpu(d: dict) -> dict:
    return {k: v.cpu() for k, v in d.items()}


def _autocast(bf16: bool):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16)


def reference(model_name: str, bf16: bool = False) -> tuple[dict, list[float]]:
    """Single process, full batch, on this rank's GPU: what every engine must reproduce."""
    device = comm_device()
    model = make_model(model_name, seed=0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in make_batch(model_name, step))
        with _autocast(bf16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return _cpu(state(model)), torch.stack(losses).cpu().tolist()


def train_ddp(engine: str, model_name: str, bucket_mb: float | None, accumulate: int, bf16: bool = False) -> dict:
    """Rank-specific seeds (wrapping must fix them; `simple` verifies instead), a shard of each batch per rank."""
    rank, ws, device = dist.get_rank(), dist.get_world_size(), comm_device()
    model = make_model(model_name, seed=0 if engine == "simple" else rank * 17).to(device)
    ddp = wrap(engine, model, bucket_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = make_batch(model_name, step)
        x, y = shard_batch(x, rank, ws).to(device), shard_batch(y, rank, ws).to(device)
        opt.zero_grad(set_to_none=step % 2 == 0)
        micro, total = x.shape[0] // accumulate, torch.zeros((), device=device)
        for m in range(accumulate):
            with ddp.no_sync() if m < accumulate - 1 else nullcontext():
                with _autocast(bf16):
                    loss = F.cross_entropy(ddp(x[m * micro:(m + 1) * micro]), y[m * micro:(m + 1) * micro])
                (loss / accumulate).backward()
            total += loss.detach() / accumulate
        ddp.finish_gradient_synchronization()
        opt.step()
        dist.all_reduce(total)
        losses.append(total / ws)
    return {"state": _cpu(state(model)), "losses": torch.stack(losses).cpu().tolist(), "calls": ddp.comm_calls,
            "device": str(next(model.parameters()).device)}


def engine_matrix(cases: list[tuple], bf16: bool = False) -> dict:
    """Every (engine, model, bucket_mb, accumulate) case on this rank, plus this rank's own references."""
    refs = {m: reference(m, bf16) for m in {c[1] for c in cases}}
    return {"cases": {c: train_ddp(*c, bf16=bf16) for c in cases}, "refs": refs}


def zero1_vs_adamw() -> dict:
    """10 AdamW steps of a FlatDDP ToyModel on the GPU, with ZeRO-1 and with the plain optimizer."""
    from ddp_lib.ddp import FlatDDP
    from ddp_lib.kit.models import ToyModel
    from ddp_lib.zero import ShardedOptimizer

    rank, ws, device = dist.get_rank(), dist.get_world_size(), comm_device()
    out = {}
    for sharded in (True, False):
        torch.manual_seed(0)
        model = ToyModel(depth=3).to(device)
        ddp = FlatDDP(model)
        kw = dict(lr=1e-2, weight_decay=0.1)
        opt = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, **kw) if sharded
               else torch.optim.AdamW(model.parameters(), **kw))
        for step in range(10):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 8, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(ddp(shard_batch(x, rank, ws).to(device)), shard_batch(y, rank, ws).to(device)).backward()
            ddp.finish_gradient_synchronization()
            opt.step()
        out["sharded" if sharded else "plain"] = [p.detach().cpu() for p in model.parameters()]
    return out


def profile_on_gpu() -> dict:
    """torch.profiler around BucketedDDP steps: the CUDA kernel table must show NCCL's all-reduce kernels."""
    from ddp_lib.ddp import BucketedDDP
    from ddp_lib.kit.models import ToyModel
    from ddp_lib.kit.profiling import phase, profile_steps

    device = comm_device()
    torch.manual_seed(0)
    ddp = BucketedDDP(ToyModel(in_dim=256, hidden=1024, depth=4).to(device), bucket_size_mb=1.0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(64, 256, device=device), torch.randn(64, 8, device=device)

    def step():
        opt.zero_grad()
        with phase("train.forward"):
            loss = F.mse_loss(ddp(x), y)
        with phase("train.backward"):
            loss.backward()
        with phase("train.sync"):
            ddp.finish_gradient_synchronization()
        opt.step()

    res = profile_steps(step, steps=3, warmup=1, trace_path=None)
    return dict(device=res.device, kernels=[k["name"] for k in res.kernels], kernel_table=res.kernel_table,
                comm_ms=res.comm_ms, compute_ms=res.compute_ms, step_ms=res.step_ms)


def benches_on_gpu() -> dict:
    """The all-reduce benchmark and the DDP race on this group (NCCL), with the race's memory watched:
    the MLP workload (~50 MB of fp32 parameters) makes a variant left alive plain to see."""
    from ddp_lib.bench import allreduce_rank_bench, ddp_rank_bench
    from ddp_lib.bench.timing import free_memory

    device = comm_device()
    w = torch.ones(8, 8, device=device, requires_grad=True)  # cuBLAS(Lt) workspaces of this thread and of
    F.linear(torch.ones(4, 8, device=device), w, w[0]).sum().backward()  # autograd's are allocated now, not in the race
    free_memory(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ddp = ddp_rank_bench("mlp", ["naive", "flat", "overlap", "simple", "bucketed", "torch", "torch-view"],
                         steps=2, warmup=1, batch_size=16)
    free_memory(device)
    mb = 2**20
    out = {"ddp": ddp, "race_peak_mb": (torch.cuda.max_memory_allocated(device) - before) / mb,
           "left_mb": (torch.cuda.memory_allocated(device) - before) / mb}
    out["allreduce"] = allreduce_rank_bench([2**16, 2**20, 2**22], iters=3, warmup=1)
    return out


def train_mrpc_bf16(engine: str) -> dict:
    """A few steps of lesson 06's training (offline SmolLM2 shape) with bf16 autocast on the GPUs."""
    from ddp_lib.apps.train_mrpc import TrainConfig, train

    # no checkpoint: a resumable one holds weights and AdamW state (~1.5 GB for the 135M), not what this test is about
    return train(TrainConfig(ddp=engine, max_steps=4, train_size=64, val_size=32, batch_size=8, accum=2, bf16=True,
                             checkpoint=False))


def skip_a_collective(timeout_s: float) -> str:
    """Rank 1 never joins an all-reduce on a group with a short timeout: rank 0 must fail, not hang."""
    group = dist.new_group(backend="nccl", timeout=datetime.timedelta(seconds=timeout_s))
    t = torch.ones(1, device=comm_device())
    dist.all_reduce(t, group=group)  # both ranks: the communicator is set up
    torch.cuda.synchronize()
    if dist.get_rank() == 1:
        time.sleep(10 * timeout_s)  # a rank stuck elsewhere
        return "rank 1 woke up"
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    t.item()
    return "rank 0 finished an all-reduce rank 1 never joined"


def fsdp_vs_reference(steps: int = 3) -> dict:
    """FSDP on NCCL (each rank a shard of every weight, on its GPU) against one process on the full batch."""
    from ddp_lib.fsdp import FSDP
    from ddp_lib.kit.models import ToyModel

    rank, ws, device = dist.get_rank(), dist.get_world_size(), comm_device()
    torch.manual_seed(0)
    ref = ToyModel(depth=3).to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    torch.manual_seed(0)
    fsdp = FSDP(ToyModel(depth=3).to(device))
    opt = torch.optim.SGD(fsdp.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8 * ws, 32, generator=g).to(device), torch.randint(0, 8, (8 * ws,), generator=g).to(device)
        for model, o, xs, ys in ((ref, ref_opt, x, y), (fsdp, opt, shard_batch(x, rank, ws), shard_batch(y, rank, ws))):
            o.zero_grad()
            F.cross_entropy(model(xs), ys).backward()
            if model is fsdp:
                fsdp.finish_gradient_synchronization()
            o.step()
    shard_devices = sorted({str(p.device) for p in fsdp.parameters()})
    return {"devices": shard_devices, "got": _cpu(fsdp.gather_full_params()), "want": _cpu({k: p.detach() for k, p in ref.named_parameters()})}
