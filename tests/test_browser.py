"""The course as its learners use it: JupyterLab in headless Chromium, every check on the page's DOM.

Playwright drives Debian's Chromium (`apt-get install chromium`) through `executable_path`; it never
downloads a browser. Without Chromium these tests skip, saying why; CI installs it (`.ci/run`) and
sets $DDP_BROWSER_TESTS_REQUIRED, which turns the skip into a failure. Each case saves a screenshot
under its pytest temp dir, and a failure names it and quotes the end of the server log.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _lab import ENV_REQUIRED, GRACE_S, LabServer, chromium_path, copy_notebooks  # noqa: E402
from _labpage import LabPage, pids_printed, rank_sections  # noqa: E402
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
    """Headless Chromium, `--no-sandbox` only as root (Chromium refuses to sandbox itself there); `--disable-gpu`:
    no software GL rasteriser on a machine without a GPU (about 8 % less CPU per test, measured)."""
    path = _browser_or_skip()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=path, headless=True,
                               args=(["--no-sandbox"] if os.geteuid() == 0 else []) + ["--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def lab(browser, server, tmp_path):  # browser first: without Chromium no server is started for nothing
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


# 1 -------------------------------------------------------------------------------------------------
def test_1_lesson_00_run_all(lab):
    """Run All on lesson 00: every cell runs, both ranks report, `%%rank [0]` runs on rank 0 only."""
    name = next(NOTEBOOKS.glob("00_*.ipynb")).name
    with lab.case("1_lesson_00"):
        lab.open(f"notebooks/{name}")
        lab.run_all()
        outs = lab.assert_ran_all()
        both = [o for o in outs if set(rank_sections(o)) == {0, 1}]
        assert len(both) >= 3, f"cells with a rank 0 and a rank 1 section: {len(both)}; outputs: {outs}"
        rank0 = [i for i in range(len(outs)) if re.match(r"\s*%%rank \[0\]", lab.source(i))]
        assert rank0, "lesson 00 has no `%%rank [0]` cell"
        for i in rank0:
            assert re.search(r"\brank 0\b", outs[i]) and not re.search(r"rank 1\b", outs[i]), outs[i]


INIT = ["%load_ext ddp_lib.notebook", "%dist_init -n 2"]


def stop_running_cell(lab: LabPage, path: str, cell: int, started, what: str, timeout_s: float) -> tuple[float, str]:
    """Open `path`, run the cells before `cell`, start `cell` and wait until `started()` (`what`) while it still
    runs, then press the toolbar's stop button: the seconds the cell took to end, and its output."""
    lab.open(path)
    for i in range(cell):
        lab.run_cell(i)
    lab.run_cell(cell, wait=False)
    lab.wait_for(started, 60, what)
    assert lab.state()["prompts"][cell] == "[*]:", "the cell ended before it was stopped"
    lab.toolbar("notebook:interrupt-kernel")
    return lab.wait_cell(cell, timeout_s=timeout_s), lab.output_text(cell)


# 2: lesson 02 in the browser is tests/test_browser_exercises.py's first case: its learner copy, a wrong and a right
# answer typed in, then run to its end (its figures on the page, the seed mismatch failing on every rank)


# 3 -------------------------------------------------------------------------------------------------
def test_3_live_output_and_stop_button(lab):
    """A long cell streams while it runs; the toolbar's stop button ends it; the ranks and their state stay."""
    path = lab.server.scratch("live.ipynb", INIT + [
        "kept = 10 + rank",
        "import time\nfor i in range(120):\n    print(f'tick {i}', flush=True)\n    time.sleep(0.5)",
        "print(f'after the stop: kept = {kept}')",
    ])
    seen: set[tuple[int, int]] = set()  # (rank, tick) pairs read while the cell still ran

    def ticking() -> bool:
        seen.update((int(r), int(t)) for r, t in re.findall(r"\[rank (\d)\] tick (\d+)", lab.output_text(3)))
        return {r for r, _ in seen} == {0, 1} and len({t for _, t in seen}) >= 3

    with lab.case("3_live_and_stop"):
        # left alone it would tick for another ~50 s
        took, out = stop_running_cell(lab, path, 3, ticking, "live lines from both ranks", timeout_s=30)
        assert "KeyboardInterrupt: the cell was interrupted on the ranks" in out, out
        sections = rank_sections(out)
        assert set(sections) == {0, 1} and all("KeyboardInterrupt" in s for s in sections.values()), out
        assert "tick 119" not in out and "killed" not in out and "%dist_init" not in out, out
        assert "[rank 0]" not in out, "the live view was not replaced by the rank-ordered output"
        lab.run_cell(4)
        assert rank_sections(lab.output_text(4)) == {0: "after the stop: kept = 10",
                                                    1: "after the stop: kept = 11"}, f"{took:.1f} s"


# 4 -------------------------------------------------------------------------------------------------
def test_4_rank_stuck_in_a_collective(lab):
    """Rank 0 is stopped while rank 1 waits in a barrier: the cell ends, names the killed rank; %dist_init recovers."""
    path = lab.server.scratch("stuck.ipynb", INIT + [
        "import time\nif rank == 0:\n    print('asleep', flush=True)\n"
        "    time.sleep(300)  # the stop button interrupts this\n"
        "else:\n    print('in the barrier', flush=True)\n"
        "    dist.barrier()  # waits for rank 0, which never comes: stuck in a collective",
        "%dist_init -n 2",
        "t = torch.ones(1, device=device)\ndist.all_reduce(t)\nprint(f'all_reduce after the restart: {t.item()}')",
    ])
    with lab.case("4_stuck_in_collective"):
        took, out = stop_running_cell(lab, path, 2, lambda: all(f"[rank {r}] " in lab.output_text(2) for r in (0, 1)),
                                      "both ranks inside the cell (live output)",
                                      timeout_s=GRACE_S + 30)  # without the grace period: stuck for 30 min
        assert f"rank 1 did not stop within {GRACE_S} s of being interrupted" in out and "it was killed" in out, out
        assert "run %dist_init to restart them" in out, out
        assert "KeyboardInterrupt" in rank_sections(out).get(0, ""), out
        label = lab.state()["prompts"][2].rstrip(":")  # the traceback names the cell as the page numbers it
        assert f'File "<cell {label}>", line 4' in rank_sections(out)[0], out
        lab.run_cell(3)
        assert "2 ranks ready" in lab.output_text(3), lab.output_text(3)
        lab.run_cell(4)
        assert rank_sections(lab.output_text(4)) == {0: "all_reduce after the restart: 2.0",
                                                    1: "all_reduce after the restart: 2.0"}, f"{took:.1f} s"


# 5 -------------------------------------------------------------------------------------------------
def test_5_restart_kernel_leaves_no_rank(lab):
    """Kernel > Restart Kernel (confirmed): the old kernel's ranks are gone, checked by PID."""
    path = lab.server.scratch("restart.ipynb", INIT + ["import os\nprint(f'pid {os.getpid()}')"])
    with lab.case("5_restart_kernel"):
        lab.open(path)
        lab.run_all()
        ranks = pids_printed(lab.output_text(2))
        assert len(ranks) == 2 and all(map(alive, ranks)), lab.output_text(2)
        kernel = {int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) for p in ranks}
        assert len(kernel) == 1
        lab.menu("Kernel", "kernelmenu:restart")
        lab.page.locator(".jp-Dialog .jp-mod-accept").click()
        assert wait_gone(ranks + list(kernel)) == [], "the old kernel's ranks outlived the restart"
        lab.run_cell(2)  # the new kernel has no ranks: the cell runs in the kernel itself
        assert re.fullmatch(r"pid \d+", out := lab.output_text(2).strip()) and int(out[4:]) not in kernel, out


# 6 -------------------------------------------------------------------------------------------------
def test_6_rewrapping_the_model_then_training(lab):
    """Re-running `ddp = BucketedDDP(m)` on the same `m`, then a training step: it trains, on both ranks.

    Fails until the engine removes the first wrapper's hooks: the step then raises
    "call ddp(x), not ddp.module(x)".
    """
    path = lab.server.scratch("rewrap.ipynb", INIT + [
        "from ddp_lib.ddp import BucketedDDP\nfrom ddp_lib.kit.models import ToyModel\n\n"
        "torch.manual_seed(0)\nm = ToyModel().to(device)\nx = torch.randn(8, 32, device=device)",
        "ddp = BucketedDDP(m)",
        "opt = torch.optim.SGD(ddp.parameters(), lr=0.1)\nopt.zero_grad()\n"
        "ddp(x).square().mean().backward()\nddp.finish_gradient_synchronization()\nopt.step()\n"
        "print('one training step')",
    ])
    with lab.case("6_rewrap"):
        lab.open(path)
        lab.run_all()
        lab.assert_ran_all()
        lab.run_cell(3)  # the learner re-runs the wrapping cell...
        lab.run_cell(4)  # ...and trains on
        assert lab.stderr_texts() == [], lab.stderr_texts()
        assert rank_sections(lab.output_text(4)) == {0: "one training step", 1: "one training step"}


# bad input ------------------------------------------------------------------------------------------
def test_7_dead_kernel_fails_with_screenshot_and_log(lab):
    """A kernel that dies mid-run fails the case at once, with the screenshot and the server log; no rank is left."""
    path = lab.server.scratch("dies.ipynb", INIT + [
        "import os\nprint(f'pid {os.getpid()}')",
        "%dist_mode --disable",
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)  # the kernel itself dies",
        "print('never runs')",
    ])
    with pytest.raises(AssertionError) as failure:
        with lab.case("7_kernel_dies"):
            lab.open(path)
            for i in range(4):  # each cell's output on the page before the kernel dies: a SIGKILLed kernel
                lab.run_cell(i)  # loses the messages its I/O thread had not yet sent (seen under load)
            lab.run_from(4, timeout_s=120)  # the kernel dies in the first of these cells
    msg = str(failure.value)
    assert "the kernel died" in msg, msg  # at once, not after Run All's time limit
    shot = Path(re.search(r"screenshot of the page: (\S+)", msg).group(1))
    assert shot.is_file() and shot.stat().st_size > 10_000, msg
    assert "server log (end):" in msg and "restarting kernel" in msg, msg
    ranks = pids_printed(lab.output_text(2))
    assert len(ranks) == 2 and wait_gone(ranks) == [], f"ranks of the dead kernel left: {ranks}"
    lab.page.locator(".jp-Dialog .jp-mod-accept").click()  # JupyterLab's "Kernel Restarting" notice
    lab.wait_for(lambda: lab.kernel_state() == "idle", 60, "the automatically restarted kernel")
