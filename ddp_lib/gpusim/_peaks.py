"""Each simulated process's peak per GPU and host memory, written to `$DDP_GPU_SIM_PEAKS/<pid>.json` (dry runs of
the lessons: `ddp_lib.gpusim.run --dry` sums them per lesson).

A daemon thread rewrites the file once a second when a figure changed, and once more at exit: ranks ended by a signal
(`%dist_shutdown`) lose at most the last second. GPUs are named by their index on the box (CUDA_VISIBLE_DEVICES
mapped back), so a kernel and a rank sharing GPU 0 are both counted on it.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import resource
import sys
import threading
import time
from pathlib import Path

ENV = "DDP_GPU_SIM_PEAKS"
_state = {"last": None}


def _physical(index: int) -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return index
    ids = [int(p) for p in visible.split(",") if p.strip().isdigit()]
    return ids[index] if index < len(ids) else index


def snapshot() -> dict:
    """This process's record: its role, its peak bytes per GPU of the box, its peak resident host memory."""
    from ddp_lib.gpusim import _memory

    _memory.settle()
    return {"pid": os.getpid(), "rank": os.environ.get("RANK"), "argv0": os.path.basename(sys.argv[0] if sys.argv else ""),
            "gpu_peak_bytes": {str(_physical(i)): b for i, b in sorted(_memory.top.items())},
            "host_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def write(folder: Path) -> None:
    """Write this process's record when it changed since the last write."""
    record = snapshot()
    key = (record["gpu_peak_bytes"], record["host_max_rss_bytes"])
    if key == _state["last"]:
        return
    _state["last"] = key
    path = folder / f"{record['pid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _loop(folder: Path) -> None:
    while True:
        time.sleep(1.0)
        try:
            write(folder)
        except OSError:
            pass


def start() -> None:
    """Record this process's peaks under $DDP_GPU_SIM_PEAKS, if set (called by `ddp_lib.gpusim.activate`)."""
    where = os.environ.get(ENV)
    if not where:
        return
    folder = Path(where)
    folder.mkdir(parents=True, exist_ok=True)

    def begin() -> None:
        _state["last"] = None
        threading.Thread(target=_loop, args=(folder,), daemon=True, name="gpusim-peaks").start()
    begin()
    os.register_at_fork(after_in_child=begin)  # a forked rank records its own peaks under its own pid
    atexit.register(lambda: write(folder))


def collect(folder: Path) -> dict:
    """The records under `folder`, summed: per GPU of the box the largest one process reached and the sum over the
    processes that used it (an upper bound of what they held together), and the largest host RSS of one process."""
    per_gpu: dict[str, int] = {}
    sum_gpu: dict[str, int] = {}
    host = 0
    for path in sorted(folder.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for gpu, b in rec["gpu_peak_bytes"].items():
            per_gpu[gpu] = max(per_gpu.get(gpu, 0), b)
            sum_gpu[gpu] = sum_gpu.get(gpu, 0) + b
        host = max(host, rec["host_max_rss_bytes"])
    gib = 2**30
    return {"gpu_peak_gib": {g: round(b / gib, 2) for g, b in sorted(per_gpu.items())},
            "gpu_sum_gib": {g: round(b / gib, 2) for g, b in sorted(sum_gpu.items())},
            "host_max_rss_gib": round(host / gib, 2)}


def table(files: list[Path]) -> str:
    """A markdown table of the lessons' dry results and peaks, one column per peaks.json (profile and ranks)."""
    runs = [json.loads(Path(f).read_text()) for f in files]
    heads = [f"{r['profile']} -n {r['n']}" for r in runs]
    lessons = sorted({name for r in runs for name in r["lessons"]})
    rows = ["| lesson | " + " | ".join(heads) + " |", "|---|" + "---|" * len(runs)]
    for name in lessons:
        cells = []
        for r in runs:
            p = r["lessons"].get(name)
            if p is None:
                cells.append("not run")
                continue
            gpus = ", ".join(f"{v:.2f}" for _, v in sorted(p["gpu_peak_gib"].items(), key=lambda kv: int(kv[0])))
            result = re.sub(r" \([^)]*CPU\)|RankError: \d+ rank\(s\) failed: rank 0: ", "", p["result"])
            if died := re.search(r"rank (\d+): died \(exit code (-?\d+)\)", result):  # the others only lost their peer
                result = result.split("]: ")[0] + f"]: rank {died[1]} died (exit code {died[2]})"
            result = result.split("; rank 1:")[0][:90]
            cells.append(f"{result}; GPU GiB [{gpus or '-'}]; host {p['host_max_rss_gib']:.1f} GiB")
        rows.append(f"| {name[:2]} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table([Path(a) for a in sys.argv[1:]]))
