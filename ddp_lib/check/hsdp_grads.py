"""check_hsdp: lesson 08's HSDP gradient path, `fn(flat, shard_group, replicate_group)`, on a (2, 2) mesh of 4 ranks.

The lesson's notebook runs 2 ranks: there `check_hsdp` ships the learner's function (its code and the globals it
names) to 4 fresh gloo ranks started from rank 0, runs the check there and hands every notebook rank the result.
"""

from __future__ import annotations

import marshal
import pickle
import sys
import types
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddp_lib.check._runner import (CheckResult, Mismatch, Property, Row, _timeout, collective_groups,
                                   learner_namespaces, max_diff, run_check)
from ddp_lib.devices import comm_device

SHIP_HINT = "define fn at the top level of the notebook, naming only modules and importable objects"
N = 5  # elements of each rank's chunk: the flat gradient has shard size x N
_meshes: dict[int, Any] = {}


def _kind(name: str) -> str:
    return "reduce_scatter" if "reduce_scatter" in name else "all_reduce" if "all_reduce" in name else name


def _flat(r: int, shard: int) -> torch.Tensor:
    """Global rank r's full gradient (its micro-batch's), different on every rank."""
    return torch.randn(shard * N, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64).float()


def check_hsdp(fn: Callable, timeout_s: float | None = None) -> CheckResult:
    """`fn(flat, shard_group, replicate_group)` takes this rank's full gradient [shard size * n] and returns its
    chunk [n] of the gradient averaged over every rank: a reduce-scatter in the shard group and an all-reduce
    across the replicate group (either order). On a default group of 4 ranks (or more, even) it runs there;
    otherwise rank 0 runs it on 4 spawned gloo ranks."""
    ws = dist.get_world_size() if dist.is_initialized() else 1
    if ws >= 4 and ws % 2 == 0:
        return _check_here(fn, timeout_s)
    from ddp_lib.launch import spawn

    box = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        limit = _timeout(timeout_s)
        try:  # a fifth of the time is left for starting the 4 ranks; the spawn's own limit is a last resort
            box[0] = spawn(_remote, world_size=4, backend="gloo", args=(ship(fn), 0.8 * limit),
                           timeout_s=limit + 30)[0]
        except Exception as e:  # noqa: BLE001 - every notebook rank must get an answer, never wait for ever
            first = (str(e).strip().splitlines() or [""])[0][:200]
            box[0] = CheckResult("check_hsdp", [Row("runs on 4 ranks", "FAIL", [0], None,
                                                       f"{type(e).__name__}: {first}", SHIP_HINT)])
        print(box[0].table(), flush=True)
    if dist.is_initialized() and ws > 1:
        dist.broadcast_object_list(box, src=0)  # .passed and .failed identical on every notebook rank
    return box[0]


def _hsdp_groups(ws: int, replicas: int, shard: int) -> tuple:
    """The shard and replicate groups of a (replicas, shard) mesh, built once per world size."""
    from ddp_lib.fsdp.collectives import hsdp_groups, hsdp_mesh

    if ws not in _meshes:
        _meshes[ws] = hsdp_mesh(replicas, shard)  # built before the properties: its groups are no learner call
    return hsdp_groups(_meshes[ws])


def _check_here(fn: Callable, timeout_s: float | None, quiet: bool = False) -> CheckResult:
    rank, ws = dist.get_rank(), dist.get_world_size()
    replicas, shard = 2, ws // 2
    shard_pg, replicate_pg = _hsdp_groups(ws, replicas, shard)
    shard_ranks = tuple(dist.get_process_group_ranks(shard_pg))
    replica_ranks = tuple(dist.get_process_group_ranks(replicate_pg))
    world = "the world group (all ranks)"
    name = {shard_ranks: "the shard group", replica_ranks: "the replicate group", tuple(range(ws)): world}
    dev = comm_device()

    def run() -> torch.Tensor:
        return fn(_flat(rank, shard).to(dev), shard_pg, replicate_pg)

    def groups() -> None:
        try:
            run()
            err = None
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - a collective in the wrong group often raises: diagnose the group
            err = e
        got = [(_kind(c), name.get(g, f"ranks {list(g)}")) for c, g in collective_groups()]
        right = [("reduce_scatter", "the shard group"), ("all_reduce", "the replicate group")]
        if err is None and got in (right, right[::-1]):
            return None
        said = ", ".join(f"{k} in {g}" for k, g in got) or "no collective"
        raise Mismatch(f"issued {said}: {_wrong_groups(got, err, world)}")

    def average() -> float:
        out = run()
        want = (sum(_flat(r, shard) for r in range(ws)) / ws).view(shard, N)[rank % shard]
        if not torch.is_tensor(out) or out.shape != want.shape:
            raise Mismatch(f"returned {getattr(out, 'shape', type(out).__name__)}, expected a chunk of {N}")
        try:
            return max_diff({"chunk": out}, {"chunk": want})
        except Mismatch as e:
            _wrong_division(out, want, shard, replicas, ws, e)
            raise

    return run_check("check_hsdp", [
        Property("reduce-scatter in the shard group, all-reduce across replicas", groups,
                 "compat.reduce_scatter_single(out, flat, group=shard_group), then "
                 "dist.all_reduce(out, group=replicate_group)"),
        Property("my chunk of the average over every rank", average,
                 "divide once, by every rank: dist.get_world_size(shard_group) * dist.get_world_size(replicate_group)",
                 needs=("reduce-scatter in the shard group, all-reduce across replicas",)),
    ], timeout_s, learner_namespaces(fn), quiet=quiet)


def _wrong_groups(got: list[tuple[str, str]], err: Exception | None, world: str) -> str:
    """Why the collectives `got` ((kind, group name) each) are not HSDP's; re-raise `err` when no group explains it."""
    if any(g == world for _, g in got):
        return "a collective over all ranks (no group=?): HSDP keeps each inside one dimension of the mesh"
    if ("reduce_scatter", "the replicate group") in got:
        return "the reduce-scatter ran across replicas: it splits the weight, so it belongs to the shard group"
    if ("all_reduce", "the shard group") in got:
        return "the all-reduce ran inside the shard group: the other replica's gradient never arrives"
    if err is not None:
        raise err
    if "all_reduce" not in [k for k, _ in got]:
        return "no all-reduce across replicas: each replica would keep the average of its own half of the batch"
    return "expected one reduce-scatter in the shard group and one all-reduce in the replicate group"


def _wrong_division(out: torch.Tensor, want: torch.Tensor, shard: int, replicas: int, ws: int, e: Mismatch) -> None:
    """Raise a Mismatch naming the division when `out` is a usual wrong multiple of the average `want`."""
    ratio = (out.double().cpu() / want.double()).median().item()
    for k, said in ((shard, "divided by the shard size only"), (replicas, "divided by the replicas only"),
                    (1 / ws, f"divided twice (by {ws * ws})"), (ws, "not divided at all")):
        if abs(ratio - k) < 1e-3 * max(1, k):
            raise Mismatch(f"{ratio:.3g} x the average: {said}", e.diff) from None


# ---------------------------------------------------------------------------- a notebook function, to other ranks
def ship(fn: Callable) -> tuple:
    """`fn` as bytes fresh processes can rebuild: its code, and the globals it names (modules and importable
    objects by reference, anything else pickled; `rank`, `world_size`, `device` are rebound where it lands)."""
    if fn.__closure__:
        raise ValueError(f"{fn.__name__} uses variables of an enclosing function: define it at the top level")
    names, todo = set(), [fn.__code__]
    while todo:
        code = todo.pop()
        names.update(code.co_names)
        todo.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    env = {}
    for n in names - {"rank", "world_size", "device"}:
        if n not in fn.__globals__:
            continue
        v = fn.__globals__[n]
        if isinstance(v, types.ModuleType):
            env[n] = ("module", v.__name__)
        elif (attr := _importable(v)) is not None:
            env[n] = ("ref", v.__module__, attr)
        else:
            try:
                env[n] = ("value", pickle.dumps(v))
            except Exception:  # noqa: BLE001 - a global it cannot carry stays missing: a NameError if used
                pass
    return marshal.dumps(fn.__code__), fn.__name__, pickle.dumps(fn.__defaults__), env


def _importable(v: Any) -> str | None:
    """The name under which `v`'s own module holds it (a function, class or object defined there), else None."""
    module = sys.modules.get(getattr(v, "__module__", None) or "")
    if module is None or getattr(v, "__module__", "").startswith("__"):
        return None
    return next((k for k, x in vars(module).items() if x is v), None)


def unship(shipped: tuple) -> Callable:
    """The function `ship` packed, with its globals, in this process."""
    import importlib

    code, name, defaults, env = shipped
    g: dict[str, Any] = {"__builtins__": __builtins__, "__name__": "__shipped__"}
    for n, (how, *what) in env.items():
        if how == "module":
            g[n] = importlib.import_module(what[0])
        elif how == "ref":
            g[n] = getattr(importlib.import_module(what[0]), what[1])
        else:
            g[n] = pickle.loads(what[0])
    g.update(rank=dist.get_rank(), world_size=dist.get_world_size(), device=comm_device())
    return types.FunctionType(marshal.loads(code), g, name, pickle.loads(defaults))


def _remote(shipped: tuple, timeout_s: float | None) -> CheckResult:
    return _check_here(unship(shipped), timeout_s, quiet=True)
