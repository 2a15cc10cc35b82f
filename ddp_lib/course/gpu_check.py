"""`make gpu-check`: prove the GPU path on a GPU box and write one self-contained report.

    python -m ddp_lib.course.gpu_check [--out runs/gpu-report] [--lessons 00 05] [--skip-tests] [--skip-bench]

Runs the whole CPU suite with the GPUs visible (CPU code must still ask for gloo), then every `gpu`-marked
test (the engines, ZeRO-1 and FSDP on NCCL) and the demo, executes every lesson on copies with
`%dist_init -n K` (K = visible GPUs, at most 8), runs the all-reduce and DDP benchmarks on NCCL, and writes
`<out>/README.md`: devices, driver, topology, each step's outcome and log, which GPU-path defects it exercised
(from the tests' JUnit files), peak GPU memory per lesson (read on the ranks by a probe cell), and the
figures. Without a GPU it stops at once with a clear message and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE_MARK = "GPU_CHECK_MEM"
# run on every rank just before each %dist_shutdown: this session's allocator peaks, one JSON line per rank
PROBE_CELL = (f"%%distributed\nimport json as _json, torch as _torch\n"
              f"print('{PROBE_MARK}', _json.dumps(dict(rank=rank, device=str(device), "
              f"peak_allocated_mb=_torch.cuda.max_memory_allocated() / 2**20 if device.type == 'cuda' else None, "
              f"peak_reserved_mb=_torch.cuda.max_memory_reserved() / 2**20 if device.type == 'cuda' else None)))")


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


def run_logged(name: str, cmd: list[str], log: Path, timeout_s: float = 3600) -> Step:
    """Run a command with its output in `log`; a Step that passed if it exited 0."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = 124
            f.write(f"\n[gpu-check] timed out after {timeout_s:.0f} s\n")
    return Step(name, rc == 0, time.perf_counter() - t0, str(log), "" if rc == 0 else f"exit status {rc}")


def prepare_lesson(nb, ranks: int) -> int:
    """Edit a lesson copy in place: its 2-rank `%dist_init` gets `-n <ranks>`, and a memory probe runs before
    every `%dist_shutdown`. Returns the number of probes inserted."""
    import nbformat

    cells, probes = [], 0
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.lstrip().startswith("%dist_shutdown"):
            cells.append(nbformat.v4.new_code_cell(PROBE_CELL))
            probes += 1
        if cell.cell_type == "code" and "dist_init" in cell.source:
            cell.source = re.sub(r"(dist_init\b[^\n]*?)-n 2\b", rf"\1-n {ranks}", cell.source)
        cells.append(cell)
    nb.cells = cells
    return probes


def read_probes(nb) -> list[dict]:
    """The probe lines the ranks printed, from an executed lesson copy."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            for m in re.finditer(rf"{PROBE_MARK} (\{{.*?\}})", out.get("text", "")):
                found.append(json.loads(m.group(1)))
    return found


def run_lesson(path: Path, out_dir: Path, ranks: int, timeout_s: int = 1800) -> Step:
    """Execute a copy of one lesson with `ranks` ranks; keep the executed copy (even a failed one)."""
    import nbformat
    from nbclient import NotebookClient

    from ddp_lib.course.tutorial import sanitise

    nb = nbformat.read(path, as_version=4)
    prepare_lesson(nb, ranks)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0, ok, detail = time.perf_counter(), True, ""
    try:  # the kernel runs in the report folder: a lesson's relative writes (../assets) cannot touch the repo
        NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(out_dir)}}).execute()
    except Exception as e:  # noqa: BLE001 - a failing lesson is a result, not the end of the check
        ok, detail = False, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    seconds = time.perf_counter() - t0
    sanitise(nb)
    out = out_dir / path.name
    nbformat.write(nb, out)
    probes = read_probes(nb)
    peaks = [p["peak_allocated_mb"] for p in probes if p.get("peak_allocated_mb") is not None]
    reserved = [p["peak_reserved_mb"] for p in probes if p.get("peak_reserved_mb") is not None]
    return Step(path.stem, ok, seconds, str(out), detail,
                dict(ranks=ranks, devices=sorted({p["device"] for p in probes}),
                     peak_allocated_mb=max(peaks) if peaks else None, peak_reserved_mb=max(reserved) if reserved else None))


def _mb(x: float | None) -> str:
    return "–" if x is None else f"{x:,.0f}"


def _link(path: str | None, out: Path) -> str:
    """A markdown link to `path`, relative to the report folder when it lies inside it."""
    if not path:
        return ""
    p, base = Path(path).resolve(), out.resolve()
    return f"[{p.name}]({p.relative_to(base) if p.is_relative_to(base) else p})"


def write_report(out: Path, info: dict, steps: list[Step], lessons: list[Step], figures: list[str],
                 tests: dict[str, str] | None = None) -> Path:
    """Write `<out>/README.md` (and `summary.json`) from what was run; return the markdown's path.
    `tests`: {'file::test': outcome} from the pytest runs, for the issue-19 table."""
    from ddp_lib.course.gpu_items import first_hour_rows, item_rows

    out.mkdir(parents=True, exist_ok=True)
    ok = all(s.ok for s in steps + lessons)
    lines = [f"# GPU check: {'PASSED' if ok else 'FAILED'}", "",
             f"torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}, driver {info['driver']}", "",
             "| GPU | name | memory (GiB) |", "|---|---|---|"]
    lines += [f"| {g['index']} | {g['name']} | {g['memory_gib']:.1f} |" for g in info["gpus"]]
    lines += ["", "## Steps", "", "| step | result | seconds | log |", "|---|---|---|---|"]
    lines += [f"| {s.name} | {'ok' if s.ok else 'FAILED ' + s.detail} | {s.seconds:.0f} | {_link(s.log, out)} |"
              for s in steps]
    lines += ["", "## GPU-path defects: what this run exercised", ""]
    lines += item_rows(tests or {}, {s.name: s.ok for s in steps + lessons})
    lines += ["", "## The first hour on an H100: ran for real, or only by construction", ""]
    lines += first_hour_rows(tests or {})
    if lessons:
        lines += ["", "## Lessons", "", "Peak GPU memory is the largest over the ranks and the lesson's `%dist_init` sessions "
                  "(`torch.cuda.max_memory_allocated` / `max_memory_reserved`, read on each rank before `%dist_shutdown`).", "",
                  "| lesson | result | ranks | devices | seconds | peak allocated (MiB) | peak reserved (MiB) |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {_link(s.log, out)} | {'ok' if s.ok else 'FAILED ' + s.detail} | {s.extra.get('ranks')} | "
                  f"{', '.join(s.extra.get('devices') or []) or '–'} | {s.seconds:.0f} | {_mb(s.extra.get('peak_allocated_mb'))} | "
                  f"{_mb(s.extra.get('peak_reserved_mb'))} |" for s in lessons]
    if figures:
        lines += ["", "## Figures", ""] + [f"!{_link(f, out)}" for f in figures]
    lines += ["", "## Topology (`nvidia-smi topo -m`)", "", "```", info["topology"].rstrip(), "```", ""]
    (out / "summary.json").write_text(json.dumps(dict(ok=ok, info=info, steps=[s.__dict__ for s in steps],
                                                      lessons=[s.__dict__ for s in lessons], figures=figures), indent=1))
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when everything passed, 1 when something failed, 2 without a GPU."""
    p = argparse.ArgumentParser(prog="python -m ddp_lib.course.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/gpu-report")
    p.add_argument("--lessons", nargs="*", default=None, help="lesson numbers (default: all)")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
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
    if not args.skip_tests:  # the CPU suite first: on a GPU box its gloo ranks must not pick nccl
        steps.append(run_logged("cpu suite (pytest -m 'not gpu' tests)", [py, "-m", "pytest", "-m", "not gpu", "-q",
                                f"--junitxml={junit['cpu']}", "tests"], out / "logs" / "cpu_suite.log"))
        steps.append(run_logged("gpu tests (pytest -m gpu: engines, ZeRO-1, FSDP on nccl)",
                                [py, "-m", "pytest", "-m", "gpu", "-rA", f"--junitxml={junit['gpu']}", "tests"],
                                out / "logs" / "gpu_tests.log"))
        steps.append(run_logged("demo (gloo ranks on a GPU box)", [py, "-m", "ddp_lib.course.demo"], out / "logs" / "demo.log"))
    if not args.skip_bench:
        model = args.ddp_model or ("lm-xl" if min(g["memory_gib"] for g in info["gpus"]) >= 70 else "lm-medium")
        bench = out / "bench"
        for name, extra in (("allreduce", ["--world-sizes", str(ranks)]),  # one rank per GPU: NCCL
                            ("ddp", ["--model", model, "--world-size", str(ranks), "--steps", "10", "--warmup", "3"])):
            steps.append(run_logged(f"bench {name} (nccl)", [py, "-m", "ddp_lib.bench", name, "--backend", "nccl",
                                                             "--json", str(bench / f"{name}.json"), *extra],
                                    out / "logs" / f"bench_{name}.log"))
            if (bench / f"{name}.png").exists():
                figures.append(str(bench / f"{name}.png"))
    from ddp_lib.course.tutorial import lesson_paths

    for path in lesson_paths(args.lessons):  # the lessons need 2 ranks: with 1 GPU they run on gloo (the report says so)
        print(f"gpu-check: lesson {path.stem} on {max(2, ranks)} ranks ...", flush=True)
        lessons.append(run_lesson(path, out / "notebooks", max(2, ranks)))
    from ddp_lib.course.gpu_items import read_junit

    tests = {**read_junit(junit["cpu"]), **read_junit(junit["gpu"])}
    report = write_report(out, info, steps, lessons, figures, tests)
    ok = all(s.ok for s in steps + lessons)
    print(f"gpu-check: {'PASSED' if ok else 'FAILED'}; report: {report}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
