"""Which of the GPU-path defects a `make gpu-check` run exercised, read from its pytest JUnit files and steps.

Each item names the tests (a regular expression on `file::test`) and the gpu-check steps or lessons that
exercise it; the report's table says, per item, how many of those tests passed, failed or were skipped.

A second table covers the first hour on an H100 (`FIRST_HOUR`): for each item, whether this run exercised it for
real on CUDA/NCCL (a `gpu` test that covers it passed) or only by construction (CPU tests, GPUs simulated).
`untested` lists what a run could not test at all (one GPU: no NCCL between ranks), which makes it INCOMPLETE.
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


@dataclass(frozen=True)
class FirstHourItem:
    """One first-hour item: `real` matches the gpu tests that run it on CUDA/NCCL ("" where none can: it is
    checked by construction only), `cpu` the CPU tests that check it by construction."""

    title: str
    real: str
    cpu: str


FIRST_HOUR = (
    FirstHourItem("ring all-reduce posts send and receive together (batch_isend_irecv): no NCCL hang in lesson 01",
                  r"test_comm_ring\.py::test_ring_matches_all_reduce_nccl", r"test_comm_ring|test_check_ring"),
    FirstHourItem("a failed rank's pending collective marks the workers unusable (NCCL returns once queued)",
                  "", r"test_notebook_magics\.py::test_3[ef]"),
    FirstHourItem("profiling, machine labels and results follow the ranks' device, not the machine",
                  r"test_gpu\.py::test_(profiler_kernel_table|backend_choice)",
                  r"test_gpu_simulated|test_profiling"),
    FirstHourItem("one big model alive at a time (lesson 05 frees its plan; benchmarks free each variant)",
                  r"test_gpu\.py::test_benchmarks_on_nccl_one_variant_alive_at_a_time",
                  r"notebooks/05_|test_bench_memory"),
    FirstHourItem("torch floor: lessons and package use ddp_lib.compat", "", r"test_torch_floor"),
    FirstHourItem("GPUs visible but CUDA unusable (driver/wheel mismatch) says so, with the fix", "",
                  r"test_notebook_devices\.py::test_gpus_that_torch_cannot_use|test_gpu_fallback_reason"),
    FirstHourItem("FSDP: `if rank == 0: model.state_dict()` ends in a clear error, not a lost rank", "",
                  r"test_fsdp.*(rank0|rank_0|one_rank|habit)"),
    FirstHourItem("resume keeps the RNG state of the rank's own device only", "",
                  r"test_gpu_simulated\.py::test_gloo_ranks_report|test_train_mrpc\.py::test_stop_and_resume"),
)


def first_hour_rows(results: dict[str, str]) -> list[str]:
    """Markdown rows `| item | ran for real on CUDA/NCCL? | CPU tests: passed / failed / skipped |`."""
    rows = ["| first-hour item | this run | CPU tests (by construction): passed / failed / skipped |", "|---|---|---|"]
    for item in FIRST_HOUR:
        real = [v for k, v in results.items() if item.real and re.search(item.real, k)]
        cpu = [v for k, v in results.items() if re.search(item.cpu, k) and not (item.real and re.search(item.real, k))]
        if not item.real:
            verdict = "by construction only (no GPU test can run it)"
        elif "passed" in real and "failed" not in real:
            verdict = f"ran for real ({real.count('passed')} gpu test(s) passed)"
        elif "failed" in real:
            verdict = f"FAILED for real ({real.count('failed')} gpu test(s) failed)"
        else:
            verdict = "by construction only (its gpu tests were skipped: " + ("too few GPUs)" if real else "not run)")
        counts = " / ".join(str(cpu.count(s)) for s in ("passed", "failed", "skipped")) if cpu else "no test ran"
        rows.append(f"| {item.title} | {verdict} | {counts} |")
    return rows


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


def untested(info: dict, lessons: list, tests: dict[str, str]) -> list[str]:
    """What this run could not test on CUDA/NCCL, one line each (empty: nothing left out)."""
    gaps = []
    if len(info["gpus"]) < 2:
        gaps.append(f"NCCL: {len(info['gpus'])} GPU, and NCCL needs one per rank, so the lessons' -n 2 ran on gloo "
                    "ranks on the CPU and every multi-rank GPU path is untested here")
    gaps += [f"lesson {s.name}: its ranks ran on the CPU only" for s in lessons
             if s.extra.get("devices") and not any(d.startswith("cuda") for d in s.extra["devices"])]
    skipped = sorted(k for k, v in tests.items() if v == "skipped" and "gpu" in k.lower())
    if skipped:
        gaps.append(f"{len(skipped)} GPU test(s) skipped (too few GPUs or a missing feature): see the gpu tests' log")
    return gaps
