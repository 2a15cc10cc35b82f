"""Package code (and the lessons' code) runs on every torch that pyproject allows (torch>=2.4).

Names that newer releases added are reached through `ddp_lib/compat.py` (which falls back to the old
names), never called directly. The scan reads the source (ast), so it holds whatever torch is installed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOOR = "2.4"
# torch.distributed names that torch 2.4 lacks, with what to use instead
NEWER_DIST_NAMES = {
    "all_gather_single": "ddp_lib.compat.all_gather_single",
    "reduce_scatter_single": "ddp_lib.compat.reduce_scatter_single",
}
# modules that became public after 2.4 (DTensor in 2.5, fully_shard in 2.6)
NEWER_MODULES = {"torch.distributed.tensor": "2.5", "torch.distributed.fsdp.fully_shard": "2.6"}
DIST_ALIASES = {"dist", "torch.distributed", "c10d", "distributed_c10d"}


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def offences(source: str, filename: str = "<src>") -> list[str]:
    """Every use in `source` of a torch.distributed name or module newer than the floor, as 'file:line name'."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute) and node.attr in NEWER_DIST_NAMES and _dotted(node.value) in DIST_ALIASES:
            found.append(f"{filename}:{node.lineno} {_dotted(node)}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                found += [f"{filename}:{node.lineno} from {node.module} import {a.name}"
                          for a in node.names if a.name in NEWER_DIST_NAMES]
            if node.module == "torch.distributed.fsdp" and any(a.name == "fully_shard" for a in node.names):
                found.append(f"{filename}:{node.lineno} from torch.distributed.fsdp import fully_shard")
            elif node.module == "torch.distributed.tensor" or node.module.startswith("torch.distributed.tensor."):
                found.append(f"{filename}:{node.lineno} from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"{filename}:{node.lineno} import {a.name}" for a in node.names
                      if a.name == "torch.distributed.tensor" or a.name.startswith("torch.distributed.tensor.")]
    return found


def package_files() -> list[Path]:
    return sorted(p for p in (ROOT / "ddp_lib").rglob("*.py") if p.name != "compat.py")


def test_the_floor_is_the_one_pyproject_declares():
    """The name lists above are for torch>=2.4: raising the floor means revising them (and vice versa)."""
    m = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert m and m.group(1) == FLOOR, f"pyproject's torch floor is {m and m.group(1)}, this test knows {FLOOR}"


@pytest.mark.parametrize("snippet", [
    "import torch.distributed as dist\ndist.all_gather_single(out, x)",
    "import torch\ntorch.distributed.reduce_scatter_single(out, x, async_op=True)",
    "from torch.distributed import all_gather_single",
    "from torch.distributed.tensor import DTensor",
    "from torch.distributed.fsdp import fully_shard",
])
def test_the_scan_sees_a_newer_name(snippet):
    assert offences(snippet), snippet


def test_the_scan_lets_the_compat_aliases_and_old_names_through():
    ok = ("from ddp_lib.compat import all_gather_single\nall_gather_single(out, x)\n"
          "import torch.distributed as dist\ndist.all_gather_into_tensor(out, x)\ndist.reduce_scatter_tensor(o, x)\n"
          "from torch.distributed.device_mesh import init_device_mesh")
    assert offences(ok) == []


def test_package_code_uses_no_name_newer_than_the_floor():
    found = [o for p in package_files() for o in offences(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, (f"torch>={FLOOR} lacks these; call {', '.join(NEWER_DIST_NAMES.values())} instead "
                       "(or raise the floor in pyproject.toml and in this test):\n" + "\n".join(found))


def test_compat_resolves_to_a_callable_on_this_torch():
    from ddp_lib import compat

    assert callable(compat.all_gather_single) and callable(compat.reduce_scatter_single)
    shard, replicate, distribute_tensor = compat.dtensor_api()  # lesson 08's DTensor primer
    assert shard(0).dim == 0 and replicate().is_replicate() and callable(distribute_tensor)


def notebook_cells() -> list[tuple[str, str]]:
    """(label, python source) of every lesson's code cells; IPython's own lines (%magics, !shell) become `pass`."""
    import json

    cells = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(nb.read_text(encoding="utf-8"))["cells"]):
            if cell["cell_type"] != "code":
                continue
            lines = "".join(cell["source"]).splitlines()
            src = "\n".join(re.sub(r"^(\s*)[%!].*", r"\1pass", line) for line in lines)
            cells.append((f"{nb.name}[cell {i}]", src))
    return cells


def test_the_notebook_reader_sees_magic_cells():
    cells = notebook_cells()
    assert cells and any("dist." in src for _, src in cells)


def test_lesson_code_uses_no_name_newer_than_the_floor():
    """The lessons run on the learner's torch too: their code reaches newer names through ddp_lib.compat."""
    found = [o for label, src in notebook_cells() for o in offences(src, label)]
    assert not found, (f"torch>={FLOOR} lacks these; call {', '.join(NEWER_DIST_NAMES.values())} instead:\n"
                       + "\n".join(found))
