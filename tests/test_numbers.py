"""Every figure README.md and docs/*.md quote from a lesson's results equals the committed JSON it comes from.

The marker convention (for whoever writes README/docs): right after a quoted number, an HTML comment names
its source,

    BucketedDDP's step is 182.4 ms <!-- result: lesson05_race.sim.bucketed.step_ms -->
    it hides 83 % <!-- result: lesson05_race.sim.bucketed.hidden_share x100 --> of its communication
    α = 555 µs <!-- result: lesson01_alphabeta.2.alpha_us -->

- the source is `assets/results/<file>.json` (`ddp_lib.course.results.save` writes it, the lead's final
  `python -m ddp_lib.course.tutorial --in-place` commits it); the rest of the dotted path walks the JSON's keys
  (a list index is a number);
- the number is the last one before the comment, on the same line: digits with an optional sign, decimal
  point and thousands commas, optionally followed by a unit or `%`/`×` (anything but `<` up to the comment);
- an optional scale after the path (`x100` or `×100`, any factor) multiplies the JSON value first;
- the quoted number must equal the value rounded to the decimals it shows (`182.4` for 182.43; `83` for 0.8261
  ×100; `1,024` for 1024). Anything else (a missing file or key, another number) fails the test.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "assets" / "results"
MARKER = re.compile(r"(?P<num>[-+]?\d[\d,]*(?:\.\d+)?)(?P<unit>[^<\d\n]{0,24}?)\s*"
                    r"<!--\s*result:\s*(?P<path>[\w.:\-]+)(?:\s+[x×](?P<scale>[\d.e+-]+))?\s*-->")


def find_markers(text: str) -> list[dict]:
    """Every marked number in a Markdown text: the number as written, its dotted source path, the scale, line."""
    out = []
    for m in MARKER.finditer(text):
        out.append({"quoted": m["num"], "path": m["path"], "scale": float(m["scale"] or 1.0),
                    "line": text.count("\n", 0, m.start()) + 1})
    return out


def lookup(path: str, results_dir: Path = RESULTS) -> float:
    """The value at `file.key.key...` in results_dir/file.json."""
    name, *keys = path.split(".")
    file = results_dir / f"{name}.json"
    if not file.exists():
        raise KeyError(f"no committed result file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
    node = json.loads(file.read_text(encoding="utf-8"))
    for k in keys:
        if isinstance(node, list):
            node = node[int(k)]
        elif k in node:
            node = node[k]
        else:
            raise KeyError(f"{path}: no key {k!r} (have {sorted(node)[:12]})")
    if isinstance(node, bool) or not isinstance(node, (int, float)):
        raise TypeError(f"{path} is {node!r}, not a number")
    return float(node)


def agrees(quoted: str, value: float, scale: float = 1.0) -> bool:
    """Whether the quoted text is `value × scale` rounded to the decimals the text shows."""
    text = quoted.replace(",", "")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return round(value * scale, decimals) == round(float(text), decimals)


def problems(text: str, results_dir: Path = RESULTS) -> list[str]:
    """One line per marked number that disagrees with (or cannot be found in) its source."""
    bad = []
    for mk in find_markers(text):
        try:
            value = lookup(mk["path"], results_dir)
        except (KeyError, TypeError, IndexError, ValueError) as err:
            bad.append(f"line {mk['line']}: {mk['quoted']} <- {mk['path']}: {err}")
            continue
        if not agrees(mk["quoted"], value, mk["scale"]):
            bad.append(f"line {mk['line']}: quotes {mk['quoted']}, {mk['path']} is {value * mk['scale']:g}")
    return bad


DOCS = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))] if p.exists()]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_marked_figures_match_committed_results(doc):
    bad = problems(doc.read_text(encoding="utf-8"))
    assert not bad, f"{doc.relative_to(ROOT)} disagrees with assets/results:\n" + "\n".join(bad)


def test_checker_catches_disagreement(tmp_path):
    (tmp_path / "lesson05_race.json").write_text(json.dumps(
        {"sim": {"bucketed": {"step_ms": 182.43, "hidden_share": 0.8261}}, "rows": [{"calls": 1024}]}))
    (tmp_path / "lesson01_alphabeta.json").write_text(json.dumps({"2": {"alpha_us": 554.6, "beta_GBps": 0.93}}))
    good = ("step 182.4 ms <!-- result: lesson05_race.sim.bucketed.step_ms --> and 83 %"
            "<!-- result: lesson05_race.sim.bucketed.hidden_share x100 -->\n"
            "| α | 555 µs <!-- result: lesson01_alphabeta.2.alpha_us --> | 0.93 GB/s"
            "<!--result: lesson01_alphabeta.2.beta_GBps--> | 1,024 <!-- result: lesson05_race.rows.0.calls --> |")
    assert len(find_markers(good)) == 5
    assert problems(good, tmp_path) == []
    stale = good.replace("182.4 ms", "107.6 ms").replace("83 %", "17 %")
    assert len(problems(stale, tmp_path)) == 2
    assert "no key 'torch'" in problems("1.0 <!-- result: lesson05_race.sim.torch.step_ms -->", tmp_path)[0]
    assert "no committed result file" in problems("3 <!-- result: lesson09_none.x -->", tmp_path)[0]
    assert problems("182.43 ms <!-- result: lesson05_race.sim.bucketed.step_ms -->", tmp_path) == []
    assert problems("182 ms <!-- result: lesson05_race.sim.bucketed.step_ms -->", tmp_path) == []
    assert problems("183 ms <!-- result: lesson05_race.sim.bucketed.step_ms -->", tmp_path) != []
