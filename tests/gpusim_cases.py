"""Rank functions for tests/test_gpusim.py: they run in processes where DDP_GPU_SIM is set (a simulated GPU box).

Imported by name in the ranks (the test puts tests/ on PYTHONPATH), so `ddp_lib.launch.spawn` can start them.
"""

from __future__ import annotations

import io
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_lib.launch import spawn
from ddp_lib.kit.models import ToyModel

STEPS, BATCH = 4, 8


def _batches(device):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 32, generator=g).to(device), torch.randint(0, 8, (BATCH,), generator=g).to(device))
            for _ in range(STEPS)]


BUCKET_HOOKS: dict = {}  # BucketedDDP's hooks after training on the simulated GPU


def train(engine: str | None) -> list[float]:
    """Train ToyModel with `engine` on this rank's GPU (None: one process on the CPU, the full batch)."""
    from ddp_lib.ddp import BucketedDDP, NaiveDDP
    from ddp_lib.fsdp import FSDP

    torch.manual_seed(0)
    device = torch.device("cuda", dist.get_rank()) if engine else torch.device("cpu")
    model = ToyModel().to(device)
    rank, ws = (dist.get_rank(), dist.get_world_size()) if engine else (0, 1)
    wrap = {"naive": NaiveDDP, "bucketed": BucketedDDP, "fsdp": FSDP,
            "torch": lambda m: torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank]),
            # the reducer on CUDA keeps its used-parameter map in pinned host memory and asserts is_pinned()
            "torch_unused": lambda m: torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank],
                                                                                find_unused_parameters=True),
            "torch_static": lambda m: torch.nn.parallel.DistributedDataParallel(m, device_ids=[rank],
                                                                                static_graph=True)}
    wrapped = wrap[engine](model) if engine else model
    opt = torch.optim.SGD(wrapped.parameters() if engine == "fsdp" else model.parameters(), lr=0.1)
    for x, y in _batches(device):
        n = BATCH // ws
        opt.zero_grad()  # before the forward: BucketedDDP binds the dropped .grads back to its buckets there
        loss = F.cross_entropy(wrapped(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
        loss.backward()
        if engine is not None and not engine.startswith("torch"):
            wrapped.finish_gradient_synchronization()
        opt.step()
    if engine == "bucketed":  # 4 steps, each after zero_grad() to None: one hook per bucket from the second on
        BUCKET_HOOKS.update(per_bucket=wrapped.sync.per_bucket.on, hooks=len(wrapped._hooks), buckets=len(wrapped.buckets))
    if engine == "fsdp":
        state = wrapped.gather_full_params()
        assert all(v.device == device for v in state.values()), {k: v.device for k, v in state.items()}
        return torch.cat([state[k].cpu().flatten() for k, _ in model.named_parameters()]).tolist()
    assert all(p.device == device for p in model.parameters()), [p.device for p in model.parameters()]
    return torch.cat([p.detach().cpu().flatten() for p in model.parameters()]).tolist()


def _error(fn) -> str:
    """The error `fn()` raises, as 'Type: message' (or 'no error')."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares the text
        return f"{type(e).__name__}: {e}"
    return "no error"


def defects(tmp: str) -> dict:
    """On each rank of an NCCL-sim group: the defects the simulation must catch, then what must work."""
    from ddp_lib.ddp import BucketedDDP
    from ddp_lib.notebook._worker import _collectives_issued

    rank = dist.get_rank()
    dev = torch.device("cuda", rank)
    out = {"device": str(dev)}
    out["cpu_allreduce"] = _error(lambda: dist.all_reduce(torch.ones(3)))
    out["cpu_model_wrapped"] = _error(lambda: BucketedDDP(ToyModel()))
    if rank == 0:
        torch.save({"w": torch.ones(4, device=dev)}, os.path.join(tmp, "ckpt.pt"))
    dist.barrier()
    out["checkpoint_unmapped"] = _error(
        lambda: torch.load(os.path.join(tmp, "ckpt.pt"))["w"] + torch.ones(4, device=dev))
    loaded = torch.load(os.path.join(tmp, "ckpt.pt"), map_location=dev)["w"]
    out["checkpoint_mapped"] = str(loaded.device)
    objs = [{"t": torch.ones(2, device=dev)} if rank == 0 else None]
    dist.broadcast_object_list(objs, src=0)
    out["object_device"] = str(objs[0]["t"].device)  # unpickled onto the device it was pickled from, as CUDA does
    x = torch.full((4,), float(rank + 1), device=dev)
    work = dist.all_reduce(x, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    out["completed_after_wait"] = work.is_completed()
    torch.cuda.synchronize()
    out["completed_after_sync"] = work.is_completed()
    out["avg"] = x.tolist()
    full = torch.empty(4, device=dev)
    dist.all_gather_into_tensor(full, torch.full((2,), float(rank), device=dev))
    part = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(part, torch.arange(4.0, device=dev))
    out["gather_scatter"] = (full.tolist(), part.tolist())
    peer = 1 - rank
    buf = torch.zeros(2, device=dev)
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank), device=dev), peer), dist.P2POp(dist.irecv, buf, peer)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["p2p"] = buf.tolist()
    out["monitored_barrier"] = _error(lambda: dist.monitored_barrier())
    # init_process_group(device_id=...) binds the group to this rank's GPU, so barrier picks it without a warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist.barrier()
    out["bound"] = (str(dist.distributed_c10d._get_default_group().bound_device_id), [str(w.message) for w in caught])
    # the between-cell check of %%rank reads each group's sequence number, which a real NCCL group keeps
    before = _collectives_issued(None)
    dist.all_reduce(buf)
    dist.broadcast(buf, 0)
    dist.barrier()
    after = _collectives_issued(None)
    out["issued"] = {after[name][0]: after[name][1] - before[name][1] for name in after if name in before}
    # a bound default group: DeviceMesh splits it (ncclCommSplit on a box) instead of calling new_group per subgroup
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cuda", (2, 1), mesh_dim_names=("dp", "tp"))
    summed = torch.ones(2, device=dev)
    dist.all_reduce(summed, group=mesh.get_group("dp"))
    out["mesh"] = (dist.distributed_c10d._get_default_group()._splits > 0, summed.tolist(),
                   mesh.get_group("tp").size(), str(mesh.get_group("dp").bound_device_id))
    out["memory"] = torch.cuda.memory_allocated() > 0
    return out


def engines(names: list[str]) -> dict:
    """Every engine in `names`, trained in turn on the simulated NCCL group."""
    return {name: train(name) for name in names}


def race() -> dict:
    """A one-step race of the toy workload on the simulated GPUs: TF32 matmuls while its steps run (and only then),
    and its throughput columns against the card's datasheet peak."""
    from ddp_lib.bench import ddp_step
    from ddp_lib.bench.race import format_race

    seen, real = set(), ddp_step.VariantRun.step

    def step(self, batch, timed=True):
        seen.add(torch.backends.cuda.matmul.allow_tf32)
        return real(self, batch, timed)

    ddp_step.VariantRun.step = step
    try:
        rows = ddp_step.ddp_rank_bench("toy", ["naive"], steps=1, warmup=0, allocator_warmup=False)
    finally:
        ddp_step.VariantRun.step = real
    return {"tf32_in_steps": sorted(seen), "tf32_after": torch.backends.cuda.matmul.allow_tf32,
            "peak_flops": rows[0]["peak_flops"], "flops_per_step": rows[0]["flops_per_step"], "table": format_race(rows)}


def on_ranks(tmp: str) -> dict:
    """Everything the ranks check: the defects first, then the engines' training, then a tiny race."""
    return {"defects": defects(tmp), "engines": engines(["naive", "bucketed", "fsdp", "torch", "torch_unused", "torch_static"]),
            "bucket_hooks": BUCKET_HOOKS, "race": race()}


def in_process() -> dict:
    """What one process of the simulated box must refuse: a mixed-device op, an allocation past the GPU's memory."""
    import copy

    a = torch.ones(3, device="cuda:0")
    twin = copy.deepcopy(ToyModel().to("cuda:1"))
    view = torch.zeros(2, 3, 1, device="cuda:0")
    view.squeeze_().t_().unsqueeze_(0)  # in-place view ops change the wrapper's shape with its data's
    grown = torch.arange(3, dtype=torch.uint8, device="cuda:0")
    grown.resize_(6)  # as scatter_object_list does to its CUDA tensors: the storage grows
    return {"deepcopy": sorted({(str(p.device), isinstance(p, torch.nn.Parameter), p.dim() > 0)
                                for p in twin.parameters()}),"mixed": _error(lambda: a + torch.ones(3)),
            "inplace_view": (tuple(view.shape), tuple(view.cpu().shape), str(view.device)),
            "resized": (tuple(grown.shape), grown[:3].tolist(), tuple(grown.cpu().shape), str(grown.device)),
            "base_deepcopy": _error(lambda: torch.Tensor.__deepcopy__(a, {})),  # new_empty([]).set_(storage)
            "two_gpus": _error(lambda: a + torch.ones(3, device="cuda:1")),
            "scalar_ok": str((a * torch.tensor(2.0)).device),
            "oom": _error(lambda: torch.empty(16 * 2**30, dtype=torch.uint8, device="cuda:1")),
            "bf16": (torch.cuda.is_bf16_supported(), torch.cuda.is_bf16_supported(including_emulation=False)),
            "props": (torch.cuda.get_device_properties(0).name, torch.cuda.get_device_capability(0)),
            "count": torch.cuda.device_count(), "profiler": _profiled(a), "rng": _cuda_rng(), "data_set": data_set(),
            # dynamo keeps one handler per function: torch.accelerator's must not be torch.cuda's own objects
            "distinct": torch.accelerator.current_stream is not torch.cuda.current_stream
            and torch.accelerator.synchronize is not torch.cuda.synchronize, "compile": _compiled()}


def _compiled() -> tuple:
    """torch.compile is not simulated: the model comes back unchanged, with a warning, and runs eagerly."""
    model = torch.nn.Linear(2, 2).to("cuda:0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = torch.compile(model, backend="eager") is model
    return same, any("torch.compile is not simulated" in str(w.message) for w in caught)


def _cuda_rng() -> tuple:
    """A CUDA generator's state is 16 bytes (seed, offset: what DTensor's RNG tracker edits); restoring it repeats
    the draws; torch.manual_seed seeds it."""
    torch.manual_seed(7)
    state = torch.cuda.get_rng_state("cuda:1")
    first = torch.rand(6, device="cuda:1")
    after = torch.cuda.get_rng_state("cuda:1").view(torch.uint64).tolist()
    torch.cuda.set_rng_state(state, "cuda:1")
    return (tuple(state.shape), state.view(torch.uint64).tolist(), after,
            torch.equal(first, torch.rand(6, device="cuda:1")), str(first.device))


def _profiled(a: torch.Tensor) -> tuple[bool, bool]:
    """torch.profiler with ProfilerActivity.CUDA on a CPU build takes the CUDA-event fallback: its events must
    record (device time), not fail with a logged backtrace per op."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        (a.reshape(1, 3) @ a.reshape(3, 1)).sum()
    rows = [e for e in prof.key_averages() if e.key == "aten::mm"]
    return len(rows) == 1, all(e.device_time_total > 0 for e in rows)


def data_set() -> tuple:
    """`p.data = flat[2:7]` (as lesson 07's flat buffer or a ZeRO shard may do): p takes the view's shape, device and
    data, and shares its storage afterwards; a tensor moved this way to another GPU holds the new data there."""
    p = torch.nn.Parameter(torch.zeros(3, device="cuda:0"))
    flat = torch.arange(10.0, device="cuda:0")
    p.data = flat[2:7]
    seen = (tuple(p.shape), str(p.device), p.sum().item(), p.tolist())
    flat.add_(1)
    p.data.mul_(2)
    q = torch.zeros(3, device="cuda:0")
    q.data = torch.ones(4, device="cuda:1")
    return seen, p.tolist(), flat.tolist(), (str(q.device), q.tolist())


def collection_inside_track() -> dict:
    """A garbage collection inside `_memory.track`'s locked part (any allocation there may start one) frees a
    simulated tensor held in a reference cycle: its release must neither deadlock nor be lost. The collection is
    forced there (a dict whose item assignment collects); a thread makes the tensor, so a deadlock is seen."""
    import gc
    import threading

    from ddp_lib.gpusim import _memory

    class Collecting(dict):
        def __setitem__(self, key, value):
            gc.collect()
            super().__setitem__(key, value)

    before = torch.cuda.memory_allocated(0)
    doomed = torch.ones(1024, device="cuda:0")
    cycle = [doomed]
    cycle.append(cycle)
    del doomed
    held = torch.cuda.memory_allocated(0) - before
    made, kept = threading.Event(), []
    _memory._storages = Collecting(_memory._storages)
    del cycle  # now garbage, collected at the next assignment into the storages
    threading.Thread(target=lambda: (kept.append(torch.zeros(256, device="cuda:0")), made.set()), daemon=True).start()
    if not made.wait(30):
        return {"deadlock": True}  # the thread holds the lock: nothing more can be allocated here
    _memory._storages = dict(_memory._storages)
    return {"deadlock": False, "held": held, "after": torch.cuda.memory_allocated(0) - before}


def main(tmp: str) -> None:
    """Print one dict: the single-process checks, the reference training, and both ranks' results."""
    ref = train(None)
    ranks = spawn(on_ranks, 2, args=(tmp,), backend="nccl")
    for r in ranks:  # how far each engine's parameters end from single-process training
        r["engines"] = {k: max(abs(a - b) for a, b in zip(v, ref)) for k, v in r["engines"].items()}
    result = {"process": in_process(), "ranks": ranks}
    result["collection_inside_track"] = collection_inside_track()  # last: on a deadlock nothing else may allocate
    print("RESULT", repr(result), flush=True)
    if result["collection_inside_track"]["deadlock"]:
        os._exit(0)  # the deadlocked thread holds the lock that interpreter shutdown would wait on


if __name__ == "__main__":
    main(sys.argv[1])
