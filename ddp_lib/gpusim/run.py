"""Execute lessons on a simulated GPU box: each lesson's kernel and ranks run under DDP_GPU_SIM=<profile>.

    python -m ddp_lib.gpusim.run --profile 2xT4                  # every lesson, %dist_init -n 2
    python -m ddp_lib.gpusim.run --profile 1xH100 -n 1 06 09     # lessons 06 and 09 at %dist_init -n 1 (09 refuses)
    python -m ddp_lib.gpusim.run --fast                          # the suite's shrink too: fewer steps

Small models (DDP_SMALL=1), as this machine computes what the GPUs would. --fast adds DDP_NBVAL=1, the test suite's
shrink (the lessons' most expensive cells run fewer steps and rounds): every cell still runs, and under the
simulation no timing means anything about a GPU, so the series loses nothing it could tell. The executed copies go to
runs/gpu-sim/<profile>/n<N>/ (committed notebooks are never rewritten), with summary.txt; each lesson prints ok or
its first error cell and error, or `refused` where a lesson that compares ranks was given too few (-n 1) and said
what to do, with its wall and CPU seconds. Exit status 1 when any lesson failed (a refusal is not a failure).
`make gpu-sim PROFILE=2xT4 LESSONS="02 09" N=2 FAST=1`.

`--dry` runs the lessons at their real sizes (no DDP_SMALL) in dry mode (DDP_GPU_SIM_DRY=1, ddp_lib.gpusim._dry: no
data behind large GPU tensors, each GPU's memory counted exactly against the card, collectives met but moving
nothing), into runs/gpu-sim-dry/<profile>/n<N>/, and records each lesson's peaks in peaks.json there (a lesson run
again replaces its entry; the others stay): per GPU of the
box the most one process held and the sum over the processes on it, and the largest host RSS of one process.
`make gpu-sim PROFILE=2xT4 DRY=1`.

`--ci-shard K` runs shard K of CI_SHARDS instead of every lesson; `--ci-shard auto` picks the shard from the commit
count (`git rev-list --count HEAD`). `make gpu-sim-ci` (what `.ci/run` runs) does that: the whole series beside the
suite took CI past its 15 minutes, so each CI run checks one shard, and successive commits pick the shards in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import re
import resource
import sys
import time
from pathlib import Path

from ddp_lib.apps.smollm2 import RANDOM_ENV
from ddp_lib.course.tutorial import NOTEBOOKS, ROOT, execute, lesson_paths
from ddp_lib.gpusim import DRY_ENV, ENV, _peaks
from ddp_lib.gpusim._profiles import PROFILES

_DIST_INIT = re.compile(r"^%dist_init -n 2\b", re.M)
# ddp_lib.devices.require_ranks' refusal: a lesson that compares ranks, run by too few, says what to do (not a defect)
_REFUSAL = re.compile(r"this lesson compares ranks and needs at least (\d+), but (\d+) run it")


# CI's share of the series (make gpu-sim-ci), one shard per run: the lessons run alone at 96c0f31, summed per shard,
# took 72, 128, 62, 75 and 57 CPU s, the whole series 360 (docs/gpu-simulation.md). Lessons 04 and
# 05 read lesson 01's alpha-beta fit for the backend they run on, and under NCCL there is no reference fit to fall back
# to (ddp_lib.bench.alphabeta.load_fit), so lesson 01 runs first in their shards.
CI_SHARDS = (("01", "04"), ("01", "05"), ("00", "06", "07"), ("02", "09"), ("03", "08", "10"))


# CI's dry pass (make gpu-sim-ci): with --dry, a shard runs only these of its lessons, the ones that ran clean dry on a
# 2xT4 at -n 2, fast (docs/gpu-simulation.md's table), cheaply enough to sit beside the suite; the others are named in
# the log (08 takes its small sizes on a T4 by its plan, 20 CPU s dry). Left out: 06 (SmolLM2's 360M shape fits a T4,
# and its real size dry cost 511 CPU s for 2 ranks on a simulated 2xA100: more than the suite leaves idle), 10 (its
# torchrun job starts fresh interpreters, not yet measured dry)
DRY_CI_OK = ("00", "01", "02", "03", "04", "05", "07", "08", "09")


def commit_count() -> int:
    """`git rev-list --count HEAD` of this checkout: the number that picks CI's shard."""
    import subprocess

    try:
        done = subprocess.run(["git", "rev-list", "--count", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, check=True)
        return int(done.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise SystemExit(f"--ci-shard auto needs this checkout's git history ({type(e).__name__}: {e}); "
                         f"name a shard instead, 0 to {len(CI_SHARDS) - 1}") from None


def ci_shard(which: str) -> tuple[int, tuple[str, ...]]:
    """The shard `--ci-shard` names: its index and its lessons. 'auto' is the commit count modulo the shards."""
    if which == "auto":
        index = commit_count() % len(CI_SHARDS)
    elif which.isdigit() and int(which) < len(CI_SHARDS):
        index = int(which)
    else:
        raise SystemExit(f"--ci-shard {which!r}: 'auto' or a shard from 0 to {len(CI_SHARDS) - 1}")
    return index, CI_SHARDS[index]


def set_ranks(n: int):
    """A notebook edit: the learner's `%dist_init -n 2` becomes `%dist_init -n <n>`."""
    def edit(nb) -> None:
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.source = _DIST_INIT.sub(f"%dist_init -n {n}", cell.source)
    return edit


# Lesson 06's ranks each train the packaged SmolLM2-135M: 2.85 GB resident per rank on the host (the kernel log of
# an OOM kill at -n 8). Where the host cannot hold that for every rank, the lessons get the random small SmolLM2.
HOST_GB_PER_RANK = 3.0


def host_available_gb() -> float:
    """Memory this host can still give, in GB: Linux's MemAvailable, else the free pages where the OS names them
    (SC_AVPHYS_PAGES), else infinity (unknown: the lessons keep their model)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024 / 1e9
    except (OSError, StopIteration, ValueError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9
        except (ValueError, OSError, AttributeError):  # macOS has no SC_AVPHYS_PAGES
            return float("inf")


def host_too_small(ranks: int, available_gb: float) -> bool:
    """True where `ranks` ranks of the packaged 135M would take more than 80% of `available_gb` on this host."""
    return ranks * HOST_GB_PER_RANK > 0.8 * available_gb


def first_error(path: Path) -> str | None:
    """'cell <index> [<id>]: <error>' for the first cell of an executed notebook with an error output, else None."""
    import nbformat

    if not path.exists():
        return None
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return f"cell {i} [{cell.get('id', '?')}]: {out.get('ename')}: {out.get('evalue', '')}".strip()
    return None


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's reaped children: the lessons' kernels, and the ranks a kernel
    reaped before it ended (a lower bound of what a lesson cost)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _one_line(text: str, limit: int = 600) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return " ".join(text.split())[:limit]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("lessons", nargs="*", help="lesson numbers (default: all)")
    parser.add_argument("--profile", default="2xT4", choices=sorted(PROFILES))
    parser.add_argument("-n", type=int, default=2, help="ranks: the lessons' %%dist_init -n 2 becomes -n N")
    parser.add_argument("--out", type=Path, default=None, help="default: runs/gpu-sim/<profile>/n<N>/")
    parser.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    parser.add_argument("--fast", action="store_true", help="DDP_NBVAL=1 as well: the suite's fewer steps")
    parser.add_argument("--dry", action="store_true", help="real sizes, dry mode (no data), peaks recorded")
    parser.add_argument("--ci-shard", metavar="K|auto", default=None,
                        help=f"only shard K of CI's {len(CI_SHARDS)} (auto: from the commit count), not every lesson")
    args = parser.parse_args(argv)
    if args.ci_shard is not None:
        if args.lessons:
            parser.error("name lessons or --ci-shard, not both")
        index, shard = ci_shard(args.ci_shard)
        args.lessons = [x for x in shard if not args.dry or x in DRY_CI_OK]
        print(f"CI shard {index} of {len(CI_SHARDS)}: lessons {' '.join(args.lessons) or 'none'} (the other shards: "
              f"{'; '.join(' '.join(s) for i, s in enumerate(CI_SHARDS) if i != index)}; every lesson: "
              f"make gpu-sim FAST=1)", flush=True)
        if args.dry:
            print(f"dry: lessons of this shard that fail dry on a 2xT4, not run: "
                  f"{' '.join(x for x in shard if x not in DRY_CI_OK) or 'none'} (docs/gpu-simulation.md)")
            if not args.lessons:
                return 0
    out_dir = (args.out or ROOT / "runs" / ("gpu-sim-dry" if args.dry else "gpu-sim") / args.profile
               / f"n{args.n}").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    # the kernels (and their ranks) inherit these; this process itself stays unsimulated
    os.environ.update({ENV: args.profile, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if args.dry:  # the real sizes: whatever the lessons pick on this card
        os.environ[DRY_ENV] = "1"
        os.environ.pop("DDP_SMALL", None)
    else:
        os.environ["DDP_SMALL"] = "1"
        os.environ.pop(DRY_ENV, None)
    if args.fast:
        os.environ["DDP_NBVAL"] = "1"
    else:  # the full steps, even when started from a process that had the suite's shrink (pytest's env)
        os.environ.pop("DDP_NBVAL", None)
    shrink = ("dry, real sizes" if args.dry else "DDP_SMALL=1") + (" DDP_NBVAL=1" if args.fast else "")
    if RANDOM_ENV not in os.environ and host_too_small(args.n, available := host_available_gb()):
        os.environ[RANDOM_ENV] = "random"  # visible below, in the summary, and in lesson 06's model line
        print(f"{args.n} ranks of the packaged SmolLM2-135M need about {args.n * HOST_GB_PER_RANK:.0f} GB of this "
              f"host's memory ({available:.0f} GB available): the lessons load the random small SmolLM2 instead",
              flush=True)
    if os.environ.get(RANDOM_ENV):
        shrink += f" {RANDOM_ENV}={os.environ[RANDOM_ENV]}"
    lines, failed, start, cpu_start = [], 0, time.perf_counter(), _children_cpu_s()
    peaks: dict = {}
    if args.dry and (out_dir / "peaks.json").exists():  # lessons an earlier run here recorded stay, unless rerun
        peaks = json.loads((out_dir / "peaks.json").read_text()).get("lessons", {})
    print(f"simulated {args.profile} ({PROFILES[args.profile].count} GPUs), %dist_init -n {args.n}, {shrink} "
          f"-> {out_dir.relative_to(ROOT) if out_dir.is_relative_to(ROOT) else out_dir}", flush=True)
    for path in lesson_paths(args.lessons, NOTEBOOKS):
        out = out_dir / path.name
        out.unlink(missing_ok=True)
        t, cpu = time.perf_counter(), _children_cpu_s()
        if args.dry:  # each simulated process of this lesson records its peaks here (ddp_lib.gpusim._peaks)
            record = out_dir / "peaks" / path.stem
            shutil.rmtree(record, ignore_errors=True)
            os.environ[_peaks.ENV] = str(record)

        def took() -> str:
            return f"{time.perf_counter() - t:.0f} s, {_children_cpu_s() - cpu:.0f} s CPU"
        try:
            execute(path, out, args.timeout, cwd=path.parent, edit=set_ranks(args.n))
            line = f"{path.stem}: ok ({took()})"
        except Exception as e:  # noqa: BLE001 - a lesson's failure is reported, and the next lesson runs
            where = first_error(out) or f"{type(e).__name__}: {_one_line(str(e))}"
            if refusal := _REFUSAL.search(where):
                line = (f"{path.stem}: refused ({took()}) at {where.split(':')[0]}: needs at "
                        f"least {refusal[1]} ranks, {refusal[2]} ran it")
            else:
                failed += 1
                line = f"{path.stem}: FAILED ({took()}) at {_one_line(where)}"
        if args.dry:
            time.sleep(1.5)  # the ranks' last records (written once a second)
            peaks[path.stem] = {"result": line.split(": ", 1)[1], **_peaks.collect(record)}
            line += f"; peak per GPU (GiB) {peaks[path.stem]['gpu_peak_gib']}, host {peaks[path.stem]['host_max_rss_gib']}"
            (out_dir / "peaks.json").write_text(json.dumps(
                {"profile": args.profile, "n": args.n, "fast": args.fast, "lessons": peaks}, indent=1) + "\n")
        print(line, flush=True)
        lines.append(line)
    refused = sum(": refused (" in line for line in lines)
    total = (f"{len(lines) - failed - refused} of {len(lines)} lessons ran clean"
             + (f", {refused} refused clearly" if refused else "") + f" in {time.perf_counter() - start:.0f} s"
             f" ({_children_cpu_s() - cpu_start:.0f} s CPU of the kernels and the ranks they reaped)")
    print(total)
    head = f"profile {args.profile}, -n {args.n}, {shrink}"
    (out_dir / "summary.txt").write_text("\n".join([head, *lines, total]) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
