"""The tested range of torch is stated once, in the Makefile's opening lines: floor, pin and newest, each with what
runs on it. The variables that install them, pyproject's floor and environment.yml's pin agree with it, and the
README, docs/contributing.md and pyproject point to it instead of repeating versions that would go stale."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKEFILE = (ROOT / "Makefile").read_text()
#: the one statement: "# Tested range of torch: floor X (...), pin Y (...), newest Z (...)"
STATEMENT = re.compile(r"Tested range of torch[^:]*: floor (\d+\.\d+) \(([^)]*)\), pin (\S+) \(([^)]*)\), "
                       r"newest (\S+) \(([^)]*)\)")


def stated() -> dict[str, str]:
    """The range as the Makefile states it."""
    opening = " ".join(line[1:].strip() for line in MAKEFILE.splitlines()[:12] if line.startswith("#"))
    m = STATEMENT.search(opening)
    assert m, "the Makefile no longer opens with '# Tested range of torch: floor X (...), pin Y (...), newest Z (...)'"
    floor, floor_what, pin, pin_what, newest, newest_what = m.groups()
    return {"floor": floor, "pin": pin, "newest": newest, "floor_what": floor_what, "pin_what": pin_what,
            "newest_what": newest_what}


def make_var(name: str) -> str:
    """A `NAME ?= torch==X` variable's version."""
    m = re.search(rf"^{name}\s*\?=\s*torch==(\S+)", MAKEFILE, re.M)
    assert m, f"Makefile: no {name} ?= torch==..."
    return m.group(1)


def test_each_end_of_the_range_says_what_runs_on_it():
    s = stated()
    assert "pyproject" in s["floor_what"] and "TORCH" in s["pin_what"] and "TORCH_NEWEST" in s["newest_what"], s
    assert "test-cuda-build" in s["newest_what"] and "suite" in s["pin_what"], s


def test_the_variables_that_install_the_range_agree_with_it():
    s = stated()
    assert make_var("TORCH") == s["pin"] and make_var("TORCH_NEWEST") == s["newest"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^\s*"torch>={re.escape(s["floor"])}"', pyproject, re.M), "pyproject's floor differs"
    env = (ROOT / "environment.yml").read_text()
    assert f"torch=={s['pin']}" in env, "environment.yml's torch differs from the pin"
    as_tuple = [tuple(int(x) for x in v.split(".")) for v in (s["floor"], s["pin"], s["newest"])]
    assert as_tuple == sorted(as_tuple), s


@pytest.mark.parametrize("doc", ["README.md", "docs/contributing.md", "pyproject.toml"])
def test_the_docs_point_to_the_range_and_name_no_other_torch(doc):
    s = stated()
    text = (ROOT / doc).read_text()
    assert "Makefile" in text, f"{doc} does not point to the Makefile's tested range"
    # other packages' versions (nccl, CUDA, drivers) are not torch's: only versions written as torch's count
    named = set(re.findall(r"torch[ =]=?=?\s*(2\.\d{1,2}\.\d+)", text)) | set(
        re.findall(r"torch (2\.\d{1,2}\.\d+)", text))
    stale = named - {s["pin"], s["newest"]}
    assert not stale, f"{doc} names torch {sorted(stale)}, outside the Makefile's range (pin {s['pin']}, " \
                      f"newest {s['newest']})"


def test_the_check_catches_a_stale_newest(monkeypatch):
    # the mutation: a Makefile whose TORCH_NEWEST moved while its statement did not
    stale = re.sub(r"^TORCH_NEWEST \?= torch==\S+", "TORCH_NEWEST ?= torch==9.9.9", MAKEFILE, flags=re.M)
    assert stale != MAKEFILE
    monkeypatch.setattr(sys.modules[__name__], "MAKEFILE", stale)
    with pytest.raises(AssertionError):
        test_the_variables_that_install_the_range_agree_with_it()
