"""`make gpu-check`: prove the GPU path on a GPU box and write one self-contained report.

    python -m ddp_lib.course.gpu_check [--out runs/gpu-report] [--lessons 00 05] [--skip-tests] [--skip-bench]

Runs the dry memory plan first (`ddp_lib.gpusim.run --dry` on the simulated box of the same card, when there is
one; `--skip-dry-plan`), then executes every lesson on copies at the learner's `%dist_init -n 2`, then runs the
whole CPU suite with the GPUs visible (CPU code must still ask for gloo), every `gpu`-marked test (the engines, ZeRO-1 and FSDP on NCCL)
and the demo, the all-reduce and DDP benchmarks on NCCL, and the lessons again at `-n K` (K = visible GPUs, at
most 8) when K > 2. Writes `<out>/README.md`: devices, driver, topology, each step's outcome and log, which
GPU-path defects it exercised (from the tests' JUnit files), peak GPU memory per cell (`gpu_probe`), the
figures, the comparison of `gpu_compare` (memory peaks against the card, the plan and the dry plan; busbw against
the link class of `nvidia-smi topo -m`; the transports NCCL chose, from the all-reduce benchmark run with
NCCL_DEBUG=INFO), and what it could not test (one GPU: no NCCL between ranks; then the verdict is INCOMPLETE, exit
status 3, not PASSED). Without a GPU it stops at once with a clear message and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddp_lib.course import gpu_compare
from ddp_lib.course.gpu_items import untested
from ddp_lib.course.gpu_probe import PROBE_MARK, prepare_lesson, read_probes  # noqa: F401 - gpu-check's API

ROOT = Path(__file__).resolve().parents[2]

class NoGPU(RuntimeError):
    """There is no CUDA GPU to check (main() exits with status 2)."""


@dataclass
class Step:
    """One thing gpu-check ran: what, whether it passed, how long it took, where its log is."""

    name: str
    ok: bool
    seconds: float
    log: str | None = None
    detail: str = ""
    extra: dict = field(default_factory=dict)


def require_gpus() -> int:
    """The number of visible CUDA GPUs; exit at once (status 2) with the reason when there is none."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise NoGPU(f"gpu-check needs a CUDA GPU, and this machine has none visible (torch {torch.__version__}, {build}; "
                    "CUDA_VISIBLE_DEVICES may hide them). Run it on a GPU box: README, 'On a cloud GPU box'.")
    return n


def device_info() -> dict:
    """GPU names and memory, driver, CUDA, NCCL and torch versions, and `nvidia-smi topo -m`."""
    import torch

    gpus = [dict(index=i, name=torch.cuda.get_device_name(i),
                 memory_gib=torch.cuda.get_device_properties(i).total_memory / 2**30)
            for i in range(torch.cuda.device_count())]
    smi = _run_text(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return dict(gpus=gpus, driver=smi.splitlines()[0].strip() if smi else "unknown (no nvidia-smi)",
                cuda=torch.version.cuda, torch=torch.__version__,
                nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                topology=_run_text(["nvidia-smi", "topo", "-m"]) or "unavailable")


def _run_text(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def run_logged(name: str, cmd: list[str], log: Path, timeout_s: float = 3600, env: dict | None = None) -> Step:
    """Run a command with its output in `log`; a Step that passed if it exited 0. `env`: added to os.environ."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                                env={**os.environ, **env} if env else None).returncode
        except subprocess.TimeoutExpired:
            rc = 124
            f.write(f"\n[gpu-check] timed out after {timeout_s:.0f} s\n")
    return Step(name, rc == 0, time.perf_counter() - t0, str(log), "" if rc == 0 else f"exit status {rc}")


def run_lesson(path: Path, out_dir: Path, ranks: int, timeout_s: int = 1800) -> Step:
    """Execute a copy of one lesson with `ranks` ranks; keep the executed copy (even a failed one)."""
    import nbformat
    from jupyter_client import AsyncKernelManager
    from nbclient import NotebookClient

    from ddp_lib.course.tutorial import sanitise
    from ddp_lib.notebook.kernels import on_ipc

    nb = nbformat.read(path, as_version=4)
    prepare_lesson(nb, ranks)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, ok, detail = time.perf_counter(), True, ""
    try:  # the kernel runs in the report folder: a lesson's relative writes (../assets) cannot touch the repo
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3", kernel_manager_class=on_ipc(AsyncKernelManager),
                       resources={"metadata": {"path": str(out_dir)}}).execute()
    except Exception as e:  # noqa: BLE001 - a failing lesson is a result, not the end of the check
        ok, detail = False, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    seconds = time.perf_counter() - t0
    sanitise(nb)
    out = out_dir / path.name
    nbformat.write(nb, out)
    probes = read_probes(nb)
    cells: dict[int, dict] = {}  # lesson cell -> the largest peaks over the ranks
    for p in probes:
        if p.get("peak_allocated_mb") is not None:
            c = cells.setdefault(p["cell"], dict(cell=p["cell"], allocated_mb=0.0, reserved_mb=0.0))
            c["allocated_mb"] = max(c["allocated_mb"], p["peak_allocated_mb"])
            c["reserved_mb"] = max(c["reserved_mb"], p["peak_reserved_mb"])
    top = sorted(cells.values(), key=lambda c: -c["allocated_mb"])
    return Step(f"{path.stem} (-n {ranks})", ok, seconds, str(out), detail,
                dict(ranks=ranks, devices=sorted({p["device"] for p in probes}), top_cells=top[:3],
                     peak_allocated_mb=top[0]["allocated_mb"] if top else None,
                     peak_reserved_mb=max(c["reserved_mb"] for c in top) if top else None))


def run_lessons(numbers: list[str] | None, out: Path, ranks: int) -> list[Step]:
    """Every lesson (or those numbered), each on a copy with `-n <ranks>`."""
    from ddp_lib.course.tutorial import lesson_paths

    steps = []
    for path in lesson_paths(numbers):
        print(f"gpu-check: lesson {path.stem} on {ranks} ranks ...", flush=True)
        steps.append(run_lesson(path, out / f"notebooks-n{ranks}", ranks))
    return steps


def _mb(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}"


def _top_cells(cells: list[dict] | None) -> str:
    return ", ".join(f"{c['cell']}: {_mb(c['allocated_mb'])}" for c in cells or []) or "–"


def _link(path: str | None, out: Path) -> str:
    """A markdown link to `path`, relative to the report folder when it lies inside it."""
    if not path:
        return ""
    p, base = Path(path).resolve(), out.resolve()
    return f"[{p.name}]({p.relative_to(base) if p.is_relative_to(base) else p})"


def compare(info: dict, lessons: list[Step], bench_log: str | Path | None = None,
            bench_json: str | Path | None = None, dry_json: str | Path | None = None) -> list[str]:
    """The report's comparison (`gpu_compare`): lessons' memory peaks against the card and the plan, the all-reduce
    benchmark's best busbw against the link class of `info['topology']`, and the transports its NCCL_DEBUG=INFO log
    names (missing files: not measured)."""
    log = Path(bench_log).read_text(errors="replace") if bench_log and Path(bench_log).exists() else ""
    rows = json.loads(Path(bench_json).read_text()) if bench_json and Path(bench_json).exists() else []
    card = min(g["memory_gib"] for g in info["gpus"])
    dry = gpu_compare.dry_peaks(json.loads(Path(dry_json).read_text())) if dry_json and Path(dry_json).exists() else {}
    memory = gpu_compare.memory_rows([{**s.extra, "name": s.name} for s in lessons], card, dry_gib=dry)
    return gpu_compare.markdown(gpu_compare.link_class(info["topology"]), gpu_compare.nccl_transports(log),
                                gpu_compare.max_busbw(rows if isinstance(rows, list) else rows.get("rows", [])),
                                memory)


def write_report(out: Path, info: dict, steps: list[Step], lessons: list[Step], figures: list[str],
                 tests: dict[str, str] | None = None, comparison: list[str] | None = None) -> Path:
    """Write `<out>/README.md` (and `summary.json`) from what was run; return the markdown's path.
    `tests`: {'file::test': outcome} from the pytest runs, for the issue-19 table; `comparison`: `compare`'s lines."""
    from ddp_lib.course.gpu_items import first_hour_rows, item_rows

    out.mkdir(parents=True, exist_ok=True)
    ok, gaps = all(s.ok for s in steps + lessons), untested(info, lessons, tests or {})
    verdict = "FAILED" if not ok else "INCOMPLETE" if gaps else "PASSED"
    lines = [f"# GPU check: {verdict}", ""]
    if gaps:
        lines += ["Not tested on this box:", ""] + [f"- {g}" for g in gaps] + [""]
    lines += [
             f"torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}, driver {info['driver']}", "",
             "| GPU | name | memory (GiB) |", "|---|---|---|"]
    lines += [f"| {g['index']} | {g['name']} | {g['memory_gib']:.1f} |" for g in info["gpus"]]
    if comparison:
        lines += [""] + comparison
    lines += ["", "## Steps", "", "| step | result | seconds | log |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {('ok' + (f': {s.detail}' if s.detail else '')) if s.ok else 'FAILED ' + s.detail} | "
              f"{s.seconds:.0f} | {_link(s.log, out)} |"
              for s in steps]
    lines += ["", "## GPU-path defects: what this run exercised", ""]
    lines += item_rows(tests or {}, {s.name: s.ok for s in steps + lessons})
    lines += ["", "## The first hour on an H100: ran for real, or only by construction", ""]
    lines += first_hour_rows(tests or {})
    if lessons:
        lines += ["", "## Lessons", "", "The learner's `-n 2` first, then one rank per GPU. Peak GPU memory is read on every rank "
                  "after every cell (`ddp_lib.course.gpu_probe`: the peaks a lesson's own `reset_peak_memory_stats` erases "
                  "are kept); the largest over the ranks, and the cells (index in the lesson) that reached the most.", "",
                  "| lesson | result | ranks | devices | seconds | peak allocated (MiB) | peak reserved (MiB) | top cells (MiB) |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {_link(s.log, out)} | {'ok' if s.ok else 'FAILED ' + s.detail} | {s.extra.get('ranks')} | "
                  f"{', '.join(s.extra.get('devices') or []) or '–'} | {s.seconds:.0f} | {_mb(s.extra.get('peak_allocated_mb'))} | "
                  f"{_mb(s.extra.get('peak_reserved_mb'))} | "
                  f"{_top_cells(s.extra.get('top_cells'))} |"
                  for s in lessons]
    if figures:
        lines += ["", "## Figures", ""] + [f"!{_link(f, out)}" for f in figures]
    lines += ["", "## Topology (`nvidia-smi topo -m`)", "", "```", info["topology"].rstrip(), "```", ""]
    (out / "summary.json").write_text(json.dumps(dict(ok=ok, info=info, steps=[s.__dict__ for s in steps],
                                                      lessons=[s.__dict__ for s in lessons], figures=figures), indent=1))
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path


def _cpu_build() -> bool:
    """Whether this torch is the CPU build, the only one ddp_lib.gpusim runs on."""
    import torch

    return torch.version.cuda is None


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when everything passed, 1 when something failed, 2 without a GPU, 3 when what ran
    passed but some of the GPU path could not be tested here (one GPU: no NCCL between ranks)."""
    p = argparse.ArgumentParser(prog="python -m ddp_lib.course.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/gpu-report")
    p.add_argument("--lessons", nargs="*", default=None, help="lesson numbers (default: all)")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-dry-plan", action="store_true", help="no dry simulation of the lessons first")
    p.add_argument("--dry-python", default=None,
                   help="a Python whose torch is the CPU build, to run the dry plan (the simulation needs it)")
    p.add_argument("--ddp-model", default=None, help="DDP race workload (default: lm-xl on >= 70 GiB GPUs, else lm-medium)")
    args = p.parse_args(argv)
    try:
        n_gpus = require_gpus()
    except NoGPU as e:
        print(e, file=sys.stderr)
        return 2
    out, py = Path(args.out), sys.executable
    info, ranks = device_info(), min(n_gpus, 8)
    steps, lessons, figures = [], [], []
    print(f"gpu-check: {n_gpus} GPU(s) ({info['gpus'][0]['name']}), driver {info['driver']}; report in {out}/")
    junit = {"cpu": out / "logs" / "cpu_suite.xml", "gpu": out / "logs" / "gpu_tests.xml"}
    # the dry plan first (ddp_lib.gpusim, the matching card simulated: real sizes, no data, memory counted), so the
    # real peaks below are compared with it; then the learner's path: -n 2 (NCCL on 2 GPUs; gloo on the CPU with one)
    profile = gpu_compare.profile_for(info["gpus"])
    if profile and not args.skip_dry_plan and (args.dry_python or _cpu_build()):
        steps.append(run_logged(f"dry memory plan (simulated {profile}, -n 2)",
                                [args.dry_python or py, "-m", "ddp_lib.gpusim.run", "--profile", profile, "-n", "2", "--dry", "--out",
                                 str(out / "dry"), *(args.lessons or [])], out / "logs" / "dry_plan.log"))
    elif profile and not args.skip_dry_plan:
        # the simulation runs on torch's CPU build only, and a GPU box has the CUDA build: say so instead of failing
        print("gpu-check: no dry memory plan: ddp_lib.gpusim needs torch's CPU build; pass --dry-python with a venv "
              f"that has it (`make setup VENV=.venv-cpu PIP_EXTRA=\"--index-url https://download.pytorch.org/whl/cpu\"`) "
              f"or compare with docs/gpu-simulation.md's dry peaks for {profile}")
    lessons += run_lessons(args.lessons, out, 2)
    if not args.skip_tests:  # on a GPU box the CPU suite's gloo ranks must not pick nccl
        steps.append(run_logged("cpu suite (pytest -m 'not gpu' tests)", [py, "-m", "pytest", "-m", "not gpu", "-q",
                                f"--junitxml={junit['cpu']}", "tests"], out / "logs" / "cpu_suite.log"))
        steps.append(run_logged("gpu tests (pytest -m gpu: engines, ZeRO-1, FSDP on nccl)",
                                [py, "-m", "pytest", "-m", "gpu", "-rA", f"--junitxml={junit['gpu']}", "tests"],
                                out / "logs" / "gpu_tests.log"))
        steps.append(run_logged("demo (gloo ranks on a GPU box)", [py, "-m", "ddp_lib.course.demo"], out / "logs" / "demo.log"))
    if not args.skip_bench:
        model = args.ddp_model or ("lm-xl" if min(g["memory_gib"] for g in info["gpus"]) >= 70 else "lm-medium")
        bench = out / "bench"
        benches = [("allreduce", ["--world-sizes", str(ranks)]),  # one rank per GPU: NCCL
                   ("ddp", ["--model", model, "--world-size", str(ranks), "--steps", "10", "--warmup", "3"])]
        if ranks < 2:  # busbw = algbw·2(n-1)/n is 0 for one rank: nothing crosses a link, there is nothing to measure
            steps.append(Step("bench allreduce (nccl)", True, 0.0, detail="not run: busbw is not defined for 1 rank "
                              "(one GPU: no link between ranks to measure)"))
            benches = benches[1:]
        for name, extra in benches:
            steps.append(run_logged(f"bench {name} (nccl)", [py, "-m", "ddp_lib.bench", name, "--backend", "nccl",
                                                             "--json", str(bench / f"{name}.json"), *extra],
                                    out / "logs" / f"bench_{name}.log",
                                    env={"NCCL_DEBUG": "INFO"} if name == "allreduce" else None))  # its transport
            if (bench / f"{name}.png").exists():
                figures.append(str(bench / f"{name}.png"))
    if ranks > 2:  # then one rank per GPU
        lessons += run_lessons(args.lessons, out, ranks)
    from ddp_lib.course.gpu_items import read_junit

    tests = {**read_junit(junit["cpu"]), **read_junit(junit["gpu"])}
    comparison = compare(info, lessons, out / "logs" / "bench_allreduce.log", out / "bench" / "allreduce.json",
                         out / "dry" / "peaks.json")
    report = write_report(out, info, steps, lessons, figures, tests, comparison)
    ok, gaps = all(s.ok for s in steps + lessons), untested(info, lessons, tests)
    print(f"gpu-check: {'FAILED' if not ok else 'INCOMPLETE' if gaps else 'PASSED'}; report: {report}")
    for gap in gaps if ok else []:
        print(f"  not tested: {gap}")
    return 1 if not ok else 3 if gaps else 0


if __name__ == "__main__":
    sys.exit(main())
