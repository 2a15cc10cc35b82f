"""Under `make lab`, the lessons' pictures load: every link resolves, and the browser shows them.

Every markdown image link of every lesson and learner copy must name a file that exists and that the lab serves
(inside the root folder of the Makefile's `LAB_ARGS`): checked on disk, for all of them. The browser part opens a
lesson and a learner copy, the two depths of link (`../assets/*.png`, `../../assets/*.png`), in a lab started with
`LAB_ARGS` (its root folder and the page it opens on), so a change to `make lab` that breaks the links fails here.
Nothing is executed: opening a notebook renders its markdown, and each `<img>` of a markdown cell must have loaded
(`naturalWidth > 0`), one for each image its markdown source links. Two notebooks, not all six with pictures: each
opened notebook costs a page load and a kernel start (the six took 75 CPU s, two take 40, children included, on the
2-core VM), and JupyterLab resolves every notebook's relative links alike.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _lab import LabServer  # noqa: E402
from test_browser import _browser_or_skip  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

# every <img> of the notebook's rendered markdown: [src as written, loaded width], once all have settled
IMAGES = """async (sel) => {
  const imgs = [...document.querySelectorAll(sel + ' .jp-MarkdownCell .jp-RenderedMarkdown img')];
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
  return imgs.map(i => [i.getAttribute('src'), i.naturalWidth]);
}"""
PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
MD_IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)|<img\s[^>]*src=[\"']([^\"']+)")


def make_lab_args() -> list[str]:
    """The options `make lab` gives `jupyter lab` (the Makefile's LAB_ARGS)."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    line = re.search(r"^LAB_ARGS\s*:?=\s*(.+)$", text, re.M)
    assert line, "the Makefile has no LAB_ARGS line: how does `make lab` start the lab?"
    return shlex.split(line.group(1))


def lab_root(args: list[str]) -> Path:
    """The folder the lab serves under those options (the working directory, `make lab`'s, by default)."""
    roots = [a.split("=", 1)[1] for a in args if a.startswith("--ServerApp.root_dir=")]
    return (ROOT / (roots[-1] if roots else ".")).resolve()


def lesson_files() -> list[Path]:
    """The lessons and, where generated, their learner copies."""
    nbs = ROOT / "notebooks"
    return sorted(nbs.glob("[0-9][0-9]_*.ipynb")) + sorted((nbs / "exercises").glob("[0-9][0-9]_*.ipynb"))


def markdown_images(path: Path) -> list[str]:
    """The image links written in the notebook's markdown cells."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    srcs = ("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in cells if c["cell_type"] == "markdown")
    return [a or b for s in srcs for a, b in MD_IMAGE.findall(s)]


def pictured() -> dict[Path, list[str]]:
    """The lessons and learner copies whose markdown links an image, with those links."""
    found = {p: srcs for p in lesson_files() if (srcs := markdown_images(p))}
    assert found, "no lesson shows a markdown image: nothing would be checked"
    return found


def browser_sample() -> list[tuple[Path, list[str]]]:
    """What the browser opens: the first pictured lesson and the first pictured learner copy (when generated)."""
    found = pictured()
    lessons = [p for p in found if p.parent.name != "exercises"]
    copies = [p for p in found if p.parent.name == "exercises"]
    assert lessons, "no lesson (only learner copies) shows a markdown image"
    return [(p, found[p]) for p in lessons[:1] + copies[:1]]


def test_every_markdown_image_link_names_a_file_the_lab_serves():
    root = lab_root(make_lab_args())
    bad = []
    for path, srcs in pictured().items():
        for src in srcs:
            target = (path.parent / src.split("?")[0].split("#")[0]).resolve()
            if "://" in src or src.startswith("/") or not target.is_file() or not target.is_relative_to(root):
                bad.append((path.relative_to(ROOT).as_posix(), src))
    assert not bad, f"markdown images that are not files inside the lab's root {root}: {bad}"


@pytest.fixture(scope="module")
def make_lab(tmp_path_factory):
    """A private lab serving the repository as `make lab` does (autosave off: the lessons stay untouched)."""
    browser_path = _browser_or_skip()
    # its own private settings, port and token; `make lab`'s options after them, so they win (ip, root, first page)
    args = make_lab_args()
    srv = LabServer(tmp_path_factory.mktemp("make_lab"), lab_root(args), extra_args=args)
    srv.start()
    try:
        yield srv, browser_path
    finally:
        leftover = srv.stop()
        assert not leftover, f"processes still running after the server stopped (killed now): {leftover}"


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_make_lab_opens_on_the_lessons_and_their_markdown_images_load(make_lab, tmp_path):
    import os

    from playwright.sync_api import sync_playwright

    srv, browser_path = make_lab
    # one lesson and one learner copy whose markdown links an image: each opened notebook starts a kernel
    expected = dict(browser_sample())
    broken, shown = [], {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                     args=(["--no-sandbox"] if os.geteuid() == 0 else []) + ["--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            # the page `make lab` opens on (the server's redirect from /) lists the lessons (and the learner
            # copies' folder, once generated)
            page.goto(f"{srv.url}/?token={srv.token}")
            listing = page.locator(".jp-DirListing-content")
            listing.locator(".jp-DirListing-item", has_text=lesson_files()[0].name).wait_for()
            if (ROOT / "notebooks" / "exercises").is_dir():
                listing.locator(".jp-DirListing-item", has_text="exercises").wait_for()
            for path, srcs in expected.items():
                rel = path.relative_to(srv.notebook_dir).as_posix()
                workspace = re.sub(r"[^A-Za-z0-9]+", "-", rel).strip("-").lower()
                page.goto(srv.lab_url(workspace, rel))
                page.locator(PANEL + " .jp-Notebook").wait_for()
                page.wait_for_function(f"n => document.querySelectorAll('{PANEL} .jp-RenderedMarkdown img')"
                                       ".length >= n", arg=len(srcs))
                shown[rel] = page.evaluate(IMAGES, PANEL)
                broken += [(rel, src) for src, width in shown[rel] if width == 0]
        except BaseException:
            page.screenshot(path=str(tmp_path / "make_lab.png"))
            raise
        finally:
            browser.close()
    assert not broken, f"images that did not load under `make lab` (lab root {srv.notebook_dir}): {broken}"
    for path, srcs in expected.items():
        rel = path.relative_to(srv.notebook_dir).as_posix()
        # JupyterLab rewrites each src into a /files/ URL of the server: match them by file name
        rendered = [src.split("?")[0].rsplit("/", 1)[-1] for src, _ in shown[rel]]
        assert rendered == [s.rsplit("/", 1)[-1] for s in srcs], f"{rel}: rendered {shown[rel]}, written {srcs}"
