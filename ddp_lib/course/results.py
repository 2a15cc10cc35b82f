"""One source for every number: lessons save their headline results here, the README quotes them.

A lesson calls `save("lesson05_race", {...})` on rank 0; that writes `runs/results/lesson05_race.json`
(ignored by git, so a learner's run leaves the tree clean). `python -m ddp_lib.course.tutorial --in-place`, the
command that regenerates the committed notebooks, copies the files its run wrote into `assets/results/`,
so the committed notebook, the committed JSON and the README's figures come from one run
(`tests/test_numbers.py` checks the README against these files).
"""

from __future__ import annotations

import json
import re
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


# `python -m ddp_lib.course.results --refresh`: after `tutorial --in-place` commits new results, rewrite every number
# that README.md and docs/*.md quote before a `<!-- result: file.key... [xSCALE] -->` marker (tests/test_numbers.py
# says the convention and checks the result), keeping the decimals each quote shows.
_MARKER = re.compile(r"(?P<num>[-+]?\d[\d,]*(?:\.\d+)?)(?P<unit>[^<\d\n]{0,24}?)\s*"
                     r"<!--\s*result:\s*(?P<path>[\w.:\-]+)(?:\s+[x×](?P<scale>[\d.e+-]+))?\s*-->")


def _value(path: str) -> float:
    """The committed value at `file.key.key...` (a list index is a number)."""
    name, *keys = path.split(".")
    node: Any = load(name)
    for k in keys:
        node = node[int(k)] if isinstance(node, list) else node[k]
    return float(node)


def refresh(docs: list[Path] | None = None) -> list[Path]:
    """Rewrite the quoted numbers of README.md and docs/*.md from assets/results; return the files changed."""
    docs = docs or [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    changed = []
    for doc in docs:
        text = doc.read_text(encoding="utf-8")

        def fix(m: re.Match) -> str:
            v = _value(m["path"]) * float(m["scale"] or 1.0)
            q = m["num"].replace(",", "")
            dec = len(q.split(".")[1]) if "." in q else 0
            new = f"{v:,.{dec}f}" if "," in m["num"] else f"{v:.{dec}f}"
            return new + m.group(0)[len(m["num"]):]

        out = _MARKER.sub(fix, text)
        if out != text:
            doc.write_text(out, encoding="utf-8")
            changed.append(doc)
    return changed


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--refresh"]:
        sys.exit("usage: python -m ddp_lib.course.results --refresh")
    for p in refresh():
        print("updated", p.relative_to(ROOT))
