"""Every relative link of README.md and docs/*.md resolves: to a file, and to a heading where it names one."""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    kept = [c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM"]
    return "".join(kept).replace(" ", "-")


def markdown_anchors(text: str) -> set[str]:
    """The anchors of a markdown file's headings, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        anchors.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return anchors


def notebook_anchors(path: Path) -> set[str]:
    """Jupyter's anchors for a notebook's markdown headings: the heading text, spaces as hyphens."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    anchors = set()
    for cell in cells:
        if cell["cell_type"] == "markdown":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            anchors |= {re.sub(r"[`*]", "", h).strip().replace(" ", "-") for h in HEADING.findall(source)}
    return anchors


def relative_links(path: Path) -> list[str]:
    """The link and image targets of a markdown file that are not URLs, outside code and comments."""
    text = COMMENT.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def broken(path: Path) -> list[str]:
    """The relative links of `path` that name no file, or a heading the file does not have."""
    bad = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in markdown_anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
        elif anchor and dest.suffix == ".ipynb" and anchor not in notebook_anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert not broken(path), "\n".join(broken(path))


def test_readme_links_every_document_and_stays_short():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{doc.name})" in readme, f"README.md does not link docs/{doc.name}"
    assert len(readme.encode()) <= 8 * 1024, f"README.md is {len(readme.encode())} bytes: keep it under 8 KB"


def test_the_checker_catches_what_it_should(tmp_path):
    (tmp_path / "a.md").write_text("# Top `code` title\n\n## Same\n\n## Same\n\n```\n# not a heading\n```\n")
    (tmp_path / "b.md").write_text(
        "[ok](a.md#top-code-title) [ok](a.md#same-1) [ok](#local) [url](https://x.org/y#z)\n"
        "[bad](a.md#not-a-heading) [bad](missing.md) ![bad](img.png) [bad](#nowhere)\n"
        "<!-- [ignored](gone.md) -->\n\n## Local\n")
    assert [b.split(":")[0] for b in broken(tmp_path / "b.md")] == ["a.md#not-a-heading", "missing.md", "img.png",
                                                                  "#nowhere"]
    assert github_slug("The package `ddp_lib`") == "the-package-ddp_lib"
    assert github_slug("On a laptop, on a GPU box") == "on-a-laptop-on-a-gpu-box"
