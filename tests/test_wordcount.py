"""Every lesson's main line (markdown outside <details>) reads in one sitting: at most 3,500 words."""
from __future__ import annotations

import re

import nbformat
import pytest

from ddp_lib.course.tutorial import lesson_paths
from ddp_lib.course.wordcount import MAIN_LINE_LIMIT, lesson_words, strip_details, words


def test_strip_details_drops_blocks_and_keeps_the_rest() -> None:
    text = "one two <details><summary>s</summary>hidden words here</details> three"
    assert words(strip_details(text)) == 3


def test_strip_details_nested_and_unclosed() -> None:
    nested = "a <details>b <details>c</details> d</details> e"
    assert strip_details(nested).split() == ["a", "e"]
    # An unclosed block hides the rest of its cell, as a renderer shows it collapsed.
    assert strip_details("a b <details>c d").split() == ["a", "b"]
    # A stray closing tag is not a block: the words around it count.
    assert strip_details("a </details> b").split() == ["a", "</details>", "b"]


@pytest.mark.parametrize("path", lesson_paths(), ids=lambda p: p.name[:2])
def test_main_line_at_most_limit(path) -> None:
    total, main_line = lesson_words(path)
    assert main_line <= total
    assert main_line <= MAIN_LINE_LIMIT, (
        f"{path.name}: {main_line} main-line words (limit {MAIN_LINE_LIMIT}); "
        "move internals, citations and caveats into <details> blocks")



@pytest.mark.parametrize("path", lesson_paths(), ids=lambda p: p.name[:2])
def test_no_text_on_the_summary_line(path) -> None:
    """Inside ``<details>`` markdown renders only after a blank line: a one-line
    ``<details><summary>Hint</summary>`x`</details>`` shows its backticks literally."""
    nb = nbformat.read(path, as_version=4)
    bad = [f"{cell.get('id')}: {m.group(0)!r}"
           for cell in nb.cells if cell.cell_type == "markdown"
           for m in re.finditer(r"</summary>[ \t]*\S[^\n]*", cell.source)]
    assert not bad, "text right after </summary> (put a blank line after it): " + "; ".join(bad)
