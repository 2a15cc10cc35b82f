"""One source for every number: lessons save their headline results here, the README quotes them.

A lesson calls `save("lesson05_race", {...})` on rank 0; that writes `runs/results/lesson05_race.json`
(ignored by git, so a learner's run leaves the tree clean). `python -m ddp_lib.course.tutorial --in-place`, the
command that regenerates the committed notebooks, copies the files its run wrote into `assets/results/`,
so the committed notebook, the committed JSON and the README's figures come from one run
(`tests/test_numbers.py` checks the README against these files).
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUNS = Path(os.environ.get("DDP_RESULTS_DIR", ROOT / "runs" / "results"))
COMMITTED = ROOT / "assets" / "results"


def machine() -> str:
    """A short description of where the numbers were measured: the ranks' GPUs, or the CPU when the ranks
    communicate on it (a box's GPUs that the ranks did not use are not where the numbers come from)."""
    import torch

    from ddp_lib.devices import ranks_use_cuda

    if ranks_use_cuda():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"CPU ({os.cpu_count()} cores, {platform.machine()})"


def save(name: str, data: dict[str, Any]) -> Path:
    """Write `data` (plus the machine and torch version) as `runs/results/<name>.json`; return the path."""
    import torch

    if not name.replace("_", "").isalnum():
        raise ValueError(f"result name must be letters, digits and underscores, got {name!r}")
    RUNS.mkdir(parents=True, exist_ok=True)
    path = RUNS / f"{name}.json"
    record = {"machine": machine(), "torch": torch.__version__, **data}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # then renamed: a reader never sees half a file
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def load(name: str, committed: bool = True) -> dict[str, Any]:
    """Read a saved result: the committed copy under assets/results (default) or this machine's under runs/."""
    path = (COMMITTED if committed else RUNS) / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no result {name!r} at {path}: run the lesson that writes it")
    return json.loads(path.read_text(encoding="utf-8"))
