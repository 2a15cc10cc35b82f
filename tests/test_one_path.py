"""Issue 38's "one path for every collective", held by reading the package's code: outside the collectives layer
(`ddp_lib/comm.py`, and `ddp_lib/comm_records.py` where it looks the torch function up), no package module calls a
torch.distributed collective itself, nor the lessons' aliases in `ddp_lib/compat.py`, nor a function that
`resolve()` returned. Checkers (`ddp_lib/check/`) are exempt, as the issue says: the learner's own calls are their
subject. The simulated GPU (`ddp_lib/gpusim/`) implements the backend under torch.distributed and calls none."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ddp_lib.comm_records import KINDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ddp_lib"
LAYER = {"ddp_lib/comm.py", "ddp_lib/comm_records.py", "ddp_lib/compat.py"}  # compat: the aliases' own definitions
EXEMPT = ("ddp_lib/check/",)
ALIASES = {"all_gather_single", "reduce_scatter_single"}  # ddp_lib.compat's, for the lessons


def direct_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of every collective called around the layer: `dist.<name>(...)` and `torch.distributed.<name>(...)`
    for a name in KINDS, `compat.<alias>(...)` and an alias imported by name, and `resolve(...)(...)`."""
    tree = ast.parse(source)
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "ddp_lib.compat" for a in node.names if a.name in ALIASES}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute):
            owner = ast.unparse(f.value)
            if f.attr in KINDS and owner in ("dist", "torch.distributed"):
                found.append((node.lineno, f"{owner}.{f.attr}"))
            elif f.attr in ALIASES and owner in ("compat", "ddp_lib.compat"):
                found.append((node.lineno, f"{owner}.{f.attr}"))
        elif isinstance(f, ast.Name) and f.id in imported:
            found.append((node.lineno, f.id))
        elif isinstance(f, ast.Call) and isinstance(f.func, ast.Name) and f.func.id == "resolve":
            found.append((node.lineno, ast.unparse(f) + "(...)"))
    return found


def package_modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                  if str(p.relative_to(ROOT)) not in LAYER and not str(p.relative_to(ROOT)).startswith(EXEMPT))


@pytest.mark.parametrize("path", package_modules())
def test_collectives_go_through_the_layer(path):
    calls = direct_calls((ROOT / path).read_text())
    assert not calls, f"{path} calls collectives around ddp_lib.comm: {calls}"


@pytest.mark.parametrize("code, what", [
    ("import torch.distributed as dist\ndist.all_reduce(t)", "dist.all_reduce"),
    ("import torch\ntorch.distributed.broadcast(t, 0)", "torch.distributed.broadcast"),
    ("from ddp_lib import compat\ncompat.all_gather_single(out, t, group=g)", "compat.all_gather_single"),
    ("from ddp_lib.compat import reduce_scatter_single as rs\nrs(out, t)", "rs"),
    ("from ddp_lib.comm import resolve\nresolve('all_reduce')(t)", "resolve('all_reduce')(...)"),
])
def test_a_call_around_the_layer_is_found(code, what):
    assert [w for _, w in direct_calls(code)] == [what]


@pytest.mark.parametrize("code", [
    "from ddp_lib import comm\ncomm.all_reduce(t, group, tally=tally)",
    "import torch.distributed as dist\nn = dist.get_world_size(group)\nop = dist.ReduceOp.SUM",
    "import torch.distributed as dist\nreal = dist.all_reduce  # saved, not called",
    "from ddp_lib.compat import fsdp2\nfully_shard, _ = fsdp2()",
])
def test_the_layer_and_other_torch_distributed_names_pass(code):
    assert direct_calls(code) == []
