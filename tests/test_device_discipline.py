"""The GPU path, checked on a CPU: every tensor the communication code creates names its device, and the
seed check of the simple DDP class costs O(1) collectives whatever the number of parameters."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib.launch import spawn

ROOT = Path(__file__).resolve().parents[1] / "ddp_lib"
# code whose tensors can reach a collective: the engines, ZeRO, FSDP, the benchmarks
COMM_CODE = sorted([*ROOT.glob("ddp/*.py"), ROOT / "optim.py", *ROOT.glob("fsdp/*.py"), *ROOT.glob("bench/*.py")])
# torch functions that allocate a new tensor on the default device (the CPU) unless told otherwise;
# *_like factories and tensor methods (new_zeros, ...) inherit their device and are fine
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "logspace", "eye",
             "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor"}


def factories_without_device(source: str) -> list[tuple[int, str]]:
    """(line, call) of every `torch.<factory>(...)` call in `source` that passes no `device=`."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" or k.arg is None for k in node.keywords)):  # **kwargs may carry it
            hits.append((node.lineno, f"torch.{node.func.attr}"))
    return hits


def test_the_check_sees_the_seed_check_bug():
    # under nccl this CPU tensor makes all_reduce raise at construction
    assert factories_without_device("mismatches = torch.zeros(1)\ndist.all_reduce(mismatches)\n") == \
        [(1, "torch.zeros")]
    assert factories_without_device("t = torch.zeros(1, device=d)\nu = torch.zeros_like(t)\nv = t.new_zeros(2)\n") == []


@pytest.mark.parametrize("path", COMM_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_communication_code_names_the_device_of_every_new_tensor(path):
    hits = factories_without_device(path.read_text())
    assert not hits, f"{path.name}: tensors created without device= (on the CPU, which nccl cannot use): {hits}"


def test_the_scope_covers_engines_optimizer_and_benchmarks():
    names = {str(p.relative_to(ROOT)) for p in COMM_CODE}
    assert {"ddp/simple.py", "ddp/base.py", "ddp/bucketed.py", "optim.py", "bench/ddp_step.py", "bench/timing.py",
            "fsdp/units.py", "fsdp/backward.py", "fsdp/hsdp.py"} <= names


COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "reduce", "gather", "scatter", "broadcast_object_list", "all_gather_object")


def _seed_check_collectives(n_params: int, differ: bool) -> dict:
    """Rank side: wrap a model of `n_params` tensors (rank 1's perturbed if `differ`), counting collectives."""
    from ddp_lib.ddp import SimpleDistributedDataParallelism

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3, bias=False) for _ in range(n_params)])
    if differ and dist.get_rank() == 1:
        with torch.no_grad():
            model[n_params // 2].weight[0, 0] += 1.0
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        SimpleDistributedDataParallelism(model)
        error = None
    except ValueError as e:
        error = str(e)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"calls": calls, "error": error}


@pytest.mark.parametrize("n_params", [0, 1, 40])
def test_seed_check_issues_a_constant_number_of_collectives(n_params):
    for r in spawn(_seed_check_collectives, world_size=2, args=(n_params, False), timeout_s=60):
        assert r["error"] is None
        assert sorted(r["calls"]) == ["all_reduce", "broadcast"], r["calls"]  # not one broadcast per parameter


def test_seed_check_fails_on_every_rank_and_counts_the_parameters_that_differ():
    results = spawn(_seed_check_collectives, world_size=2, args=(40, True), timeout_s=60)
    for r in results:  # both ranks raise (one verdict), so nobody waits in a later collective
        assert r["error"] is not None and "but 1 differ from rank 0's" in r["error"]
        assert sorted(r["calls"]) == ["all_reduce", "broadcast"]


def _bitwise_seed_check(kind: str) -> str | None:
    """Rank side: parameters whose values compare equal as floats but differ in bits, or NaN everywhere."""
    from ddp_lib.ddp import SimpleDistributedDataParallelism

    p = nn.Parameter(torch.zeros(4))
    with torch.no_grad():
        if kind == "signed_zero" and dist.get_rank() == 1:
            p[0] = -0.0
        if kind == "nan":
            p[1] = float("nan")  # the same NaN on both ranks: identical replicas, though NaN != NaN
    model = nn.Module()
    model.p = p
    try:
        SimpleDistributedDataParallelism(model)
    except ValueError as e:
        return str(e)
    return None


def test_seed_check_compares_bits_not_values():
    assert all(e is not None for e in spawn(_bitwise_seed_check, world_size=2, args=("signed_zero",), timeout_s=60))
    assert spawn(_bitwise_seed_check, world_size=2, args=("nan",), timeout_s=60) == [None, None]


def _mixed_dtypes() -> str | None:
    from ddp_lib.ddp import SimpleDistributedDataParallelism

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16), nn.Embedding(5, 2).double())
    SimpleDistributedDataParallelism(model)
    return "ok"


def test_seed_check_handles_mixed_dtypes():
    assert spawn(_mixed_dtypes, world_size=2, timeout_s=60) == ["ok", "ok"]
