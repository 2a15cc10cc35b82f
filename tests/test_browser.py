"""The course as its learners use it: JupyterLab in headless Chromium, every check on the page's DOM.

Playwright drives Debian's Chromium (`apt-get install chromium`) through `executable_path`; it never
downloads a browser. Without Chromium these tests skip, saying why; CI installs it (`.ci/run`) and
sets $DDP_BROWSER_TESTS_REQUIRED, which turns the skip into a failure. Each case saves a screenshot
under its pytest temp dir, and a failure names it and quotes the end of the server log.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _lab import ENV_REQUIRED, GRACE_S, LabServer, chromium_path, copy_notebooks  # noqa: E402
from _labpage import LabPage, executed, rank_sections  # noqa: E402
from _nbkernel import alive, wait_gone  # noqa: E402

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
pytestmark = [pytest.mark.browser, pytest.mark.timeout(400)]


def _browser_or_skip() -> str:
    """The Chromium binary; skip (fail under CI's $DDP_BROWSER_TESTS_REQUIRED) when it or Playwright is missing."""
    why = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        why = "the playwright package is not installed (pip install -e '.[dev]')"
    path = chromium_path()
    if path is None:
        why = why or "no Chromium found: apt-get install chromium (or set DDP_CHROMIUM to a Chromium binary)"
    if why and os.environ.get(ENV_REQUIRED):
        pytest.fail(f"{ENV_REQUIRED} is set but {why}")
    if why:
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One private lab for this module, serving copies of the lessons plus the scratch notebooks."""
    root = tmp_path_factory.mktemp("lab")
    nb_dir = copy_notebooks(NOTEBOOKS, root / "tree")
    srv = LabServer(root, nb_dir.parent)
    srv.start()
    try:
        yield srv
    finally:
        leftover = srv.stop()
        assert not leftover, f"processes still running after the server stopped (killed now): {leftover}"


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, `--no-sandbox` only as root (Chromium refuses to sandbox itself there)."""
    path = _browser_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, headless=True,
                               args=["--no-sandbox"] if os.geteuid() == 0 else [])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def lab(server, browser, tmp_path):
    """A fresh page; afterwards its kernels are shut down through the API and none of their ranks is left."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    ctx.set_default_timeout(60_000)
    page = LabPage(ctx.new_page(), server, tmp_path / "screenshots")
    try:
        yield page
    finally:
        ctx.close()
        left = server.shutdown_kernels()
        assert not left, f"processes left after the kernels were shut down: {left}"


def scratch(server: LabServer, name: str, cells: list[str]) -> str:
    """A notebook of code `cells` written next to the lessons; its path for LabPage.open."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    (server.notebook_dir / "scratch").mkdir(exist_ok=True)
    nbformat.write(nb, server.notebook_dir / "scratch" / name)
    return f"scratch/{name}"


def committed_images(name: str) -> int:
    """How many PNG outputs the committed lesson's code cells hold (the same run makes as many)."""
    nb = json.loads((NOTEBOOKS / name).read_text())
    return sum("image/png" in o.get("data", {}) for c in nb["cells"] if c["cell_type"] == "code"
               for o in c.get("outputs", []))


def assert_ran_all(lab: LabPage) -> list[str]:
    """Every code cell was seen running, then got its number; no error or stderr output; the outputs."""
    st = lab.state()
    assert all(st["busySeen"]), f"cells never seen running ([*]): {st['busySeen']}"
    assert all(map(executed, st["prompts"])), f"cells without an execution count: {st['prompts']}"
    counts = [int(p[1:-2]) for p in st["prompts"]]
    assert counts == sorted(set(counts)), f"execution counts out of order: {counts}"
    assert lab.stderr_texts() == [], f"stderr/error output: {lab.stderr_texts()}"
    return [lab.output_text(i) for i in range(len(st["prompts"]))]


# 1 -------------------------------------------------------------------------------------------------
def test_1_lesson_00_run_all(lab):
    """Run All on lesson 00: every cell runs, both ranks report, `%%rank [0]` runs on rank 0 only."""
    name = next(NOTEBOOKS.glob("00_*.ipynb")).name
    with lab.case("1_lesson_00"):
        lab.open(f"notebooks/{name}")
        lab.run_all()
        outs = assert_ran_all(lab)
        both = [o for o in outs if set(rank_sections(o)) == {0, 1}]
        assert len(both) >= 3, f"cells with a rank 0 and a rank 1 section: {len(both)}; outputs: {outs}"
        rank0 = [i for i in range(len(outs)) if re.match(r"\s*%%rank \[0\]", lab.source(i))]
        assert rank0, "lesson 00 has no `%%rank [0]` cell"
        for i in rank0:
            assert re.search(r"\brank 0\b", outs[i]) and not re.search(r"rank 1\b", outs[i]), outs[i]


# 2 -------------------------------------------------------------------------------------------------
def test_2_lesson_02_run_all(lab):
    """Run All on lesson 02: its figures are pictures on the page; the seed mismatch fails on every rank."""
    name = next(NOTEBOOKS.glob("02_*.ipynb")).name
    with lab.case("2_lesson_02"):
        lab.open(f"notebooks/{name}")
        lab.run_all(timeout_s=300)
        outs = assert_ran_all(lab)
        imgs = lab.panel.locator(".jp-OutputArea-output img")
        sizes = [imgs.nth(i).evaluate("i => [i.naturalWidth, i.src.slice(0, 22)]") for i in range(imgs.count())]
        assert len(sizes) == committed_images(name) > 0, f"images on the page: {sizes}"
        assert all(w > 100 and src == "data:image/png;base64," for w, src in sizes), sizes
        seed = [o for o in outs if "seed" in o and "ValueError" in o]
        assert seed, f"no seed-mismatch ValueError on the page; outputs: {outs}"
        for o in seed:
            sections = rank_sections(o)
            assert set(sections) == {0, 1} and all("ValueError" in s for s in sections.values()), o
