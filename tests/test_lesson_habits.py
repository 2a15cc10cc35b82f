"""A learner's habits on the lessons, in a real kernel with 2 gloo ranks: a cell run twice, a restart then a check."""

from __future__ import annotations

import pytest

from tests._habits import LessonKernel, text

pytestmark = [pytest.mark.slow, pytest.mark.notebook]  # a kernel, 2 ranks and a lesson's first cells: 1-2 min each


@pytest.fixture
def lesson05(tmp_path):
    lk = LessonKernel("05", tmp_path)
    yield lk
    lk.close()


def test_05_big_model_cell_run_twice_says_which_cell_to_run(lesson05):
    """c19 frees the big model at its end: its second run names the cell that builds it, not a bare NameError."""
    replies = lesson05.run(*lesson05.up_to("c19"))
    assert replies[-1].status == "ok", text(replies[-1])
    again = lesson05.run_cell("c19")
    assert again.status == "error"
    assert "run the cell above that builds it" in again.text and "NameError" not in again.text
    assert lesson05.run("c16b", "c19")[-1].status == "ok"  # the cell named, then this one: correct again


def test_05_check_after_restart_names_what_to_run(lesson05):
    """After a restart the kernel has no ranks: the your-turn cell defines the function in the kernel, and the check
    cell says to run %dist_init and the cells above instead of torch's "Default process group" error."""
    assert lesson05.run(*lesson05.up_to("c16"))[-1].status == "ok"
    left = lesson05.restart()
    assert left == [], f"processes of the old kernel still alive 15 s after the restart: {left}"
    replies = lesson05.run("c15", "c16", timeout=120)
    assert [r.status for r in replies] == ["ok", "error"]
    shown = text(replies)
    assert "check_bucket_plan() needs a process group" in shown and "%dist_init" in shown, shown


def test_08_profile_cell_keeps_its_batch_when_an_earlier_cell_is_run_again(tmp_path):
    """Lesson 08's FSDP profile (f5c0291d) trained on whatever `x, y` the last cell bound: after the first section's
    cell (f23cd765, an 8 x 3 batch) ran again it failed on a shape, and after the clipping cell (c8a1f0e9) it profiled
    a batch 1/512 the size without a word. It names its own batch now (the second case is not observable here: the
    figures vary from run to run)."""
    lk = LessonKernel("08", tmp_path)
    try:
        replies = lk.run(*lk.up_to("f5c0291d"))
        assert replies[-1].status == "ok", text(replies[-1])
        for earlier in ("f23cd765", "c8a1f0e9"):
            again = lk.run(earlier, "f5c0291d")
            assert [r.status for r in again] == ["ok", "ok"], text(again)
    finally:
        lk.close()
