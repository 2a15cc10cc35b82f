"""Which of the GPU-path defects a `make gpu-check` run exercised, read from its pytest JUnit files and steps.

Each item names the tests (a regular expression on `file::test`) and the gpu-check steps or lessons that
exercise it; the report's table says, per item, how many of those tests passed, failed or were skipped.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Item:
    """One GPU-path defect: its number, a title, the tests that cover it, and gpu-check steps/lessons."""

    number: int
    title: str
    tests: str
    steps: tuple[str, ...] = ()


ITEMS = (
    Item(1, "CPU code asks for gloo on a GPU box (make test, make demo)",
         r"test_gpu_simulated|test_ddp\.py|test_optim\.py", ("demo", "cpu suite")),
    Item(2, "timelines measure device time under NCCL (lessons 05, 08)",
         r"timeline|event|overlap_probe|kernel_time", ("05_", "08_")),
    Item(3, "torch floor: no name newer than torch>=2.4 outside compat", r"test_torch_floor"),
    Item(4, "device from the group's backends, not backend == 'nccl'",
         r"test_mesh\.py::.*(communicat|device|backend)|train_mrpc"),
    Item(5, "freezing a parameter after wrapping", r"freez|frozen"),
    Item(6, "non-contiguous gradients", r"contiguous"),
    Item(7, "bench allreduce keeps its buffer bounded", r"test_bench.*allreduce|allreduce.*bound",
         ("bench allreduce",)),
    Item(8, "get() per mesh dimension (2-D meshes)", r"test_mesh\.py::test_get|check_mesh|check_get", ("00_",)),
    Item(9, "resumable train_mrpc checkpoint", r"resume|checkpoint"),
)


def read_junit(path: Path) -> dict[str, str]:
    """{'file::test': 'passed' | 'failed' | 'skipped'} from a pytest --junitxml file ({} if it is missing)."""
    if not Path(path).exists():
        return {}
    out = {}
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        tags = {child.tag for child in case}
        out[name] = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
    return out


def item_rows(results: dict[str, str], step_results: dict[str, bool]) -> list[str]:
    """Markdown rows `| item | what | tests passed/failed/skipped | steps |` for the report."""
    rows = ["| item | what | tests: passed / failed / skipped | gpu-check steps |", "|---|---|---|---|"]
    for item in ITEMS:
        hits = [v for k, v in results.items() if re.search(item.tests, k)]
        counts = " / ".join(str(hits.count(s)) for s in ("passed", "failed", "skipped")) if hits else "no test ran"
        steps = [f"{name}: {'ok' if ok else 'FAILED'}" for name, ok in step_results.items()
                 if any(name.startswith(s) or s in name for s in item.steps)]
        rows.append(f"| {item.number} | {item.title} | {counts} | {', '.join(steps) or '–'} |")
    return rows
