"""What a learner does in JupyterLab, through Playwright: open a notebook, run cells, press buttons, read the DOM.

Every selector is scoped to the visible notebook panel, and every notebook is opened in its own
workspace: a restored workspace would re-open earlier tabs, and Run All would run the wrong notebook.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from pathlib import Path

from _lab import LabServer

PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"
STDERR = '[data-mime-type="application/vnd.jupyter.stderr"]'
RANK_HEADER = re.compile(r"^--- rank (\d+) ---$", re.M)

# Marks each code cell once its prompt has shown `[*]` (running or queued). A MutationObserver runs
# after every DOM change, so even a cell that finishes in a millisecond is seen busy; the counts
# it ends with are the same as the committed ones, so a number alone would prove nothing.
WATCH_BUSY = """(sel) => {
  const panel = document.querySelector(sel);
  const scan = () => panel.querySelectorAll('.jp-CodeCell').forEach(c => {
    const p = c.querySelector('.jp-InputPrompt');
    if (p && p.textContent.includes('*')) c.dataset.ddpBusySeen = '1';
  });
  new MutationObserver(scan).observe(panel, {subtree: true, childList: true, characterData: true});
  scan();
}"""

STATE = """(sel) => {
  const cells = [...document.querySelectorAll(sel + ' .jp-CodeCell')];
  const dialog = document.querySelector('.jp-Dialog');
  return {
    prompts: cells.map(c => (c.querySelector('.jp-InputPrompt')?.textContent || '').trim()),
    busySeen: cells.map(c => c.dataset.ddpBusySeen === '1'),
    dialog: dialog ? dialog.innerText : null,
  };
}"""


class KernelDied(AssertionError):
    """The notebook's kernel died while cells ran (JupyterLab says so and restarts it)."""


def executed(prompt: str) -> bool:
    """True for a prompt like `[12]:`: the cell ran to its end in this kernel."""
    return re.fullmatch(r"\[\d+\]:", prompt) is not None


def rank_sections(text: str) -> dict[int, str]:
    """A multi-rank output split at its `--- rank N ---` headers: rank -> what that rank printed (stripped)."""
    parts = RANK_HEADER.split(text)  # the page may put a blank line between a header and its text
    return {int(parts[i]): parts[i + 1].strip("\n") for i in range(1, len(parts) - 1, 2)}


def pids_printed(text: str) -> list[int]:
    """The PIDs that a `print(f"pid {os.getpid()}")` cell showed, one per rank section."""
    return [int(m) for s in rank_sections(text).values() for m in re.findall(r"^pid (\d+)$", s, re.M)]


class LabPage:
    """One browser page on the private lab; `case(name)` wraps a test case with its screenshot."""

    def __init__(self, page, server: LabServer, shots: Path) -> None:
        self.page, self.server, self.shots = page, server, shots
        self.panel = page.locator(PANEL)
        self.path = ""

    # -- evidence ---------------------------------------------------------------------------------
    @contextmanager
    def case(self, name: str):
        """Screenshot the page at the end of the case; a failure names it and adds the server log."""
        shot = self.shots / f"{name}.png"
        try:
            yield
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - a pytest-timeout Failed must carry the evidence too
            self.screenshot(shot)
            raise AssertionError(f"{type(e).__name__}: {e}\n\nscreenshot of the page: {shot}\n\n"
                                 f"server log (end):\n{self.server.log_tail()}") from e
        self.screenshot(shot)

    def screenshot(self, path: Path) -> None:
        """What the learner saw; never hides the original failure."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.page.screenshot(path=str(path))
        except Exception as e:  # noqa: BLE001
            path.with_suffix(".txt").write_text(f"no screenshot: {e}\n")

    # -- navigation -------------------------------------------------------------------------------
    def open(self, path: str, timeout_s: float = 120.0) -> None:
        """Open `path` (relative to the server root) in a workspace of its own; wait for an idle kernel."""
        self.path = path
        workspace = re.sub(r"[^A-Za-z0-9]+", "-", Path(path).stem).strip("-").lower()
        self.page.goto(self.server.lab_url(workspace, path))
        self.panel.locator(".jp-Notebook").wait_for(timeout=timeout_s * 1000)
        self.wait_for(lambda: self.kernel_state() == "idle", timeout_s, "the kernel to start")
        self.page.evaluate(WATCH_BUSY, PANEL)

    def kernel_state(self) -> str | None:
        """The execution state the server reports for this notebook's kernel (idle, busy, restarting...)."""
        for s in self.server.api("GET", "/api/sessions"):
            if s["path"] == self.path and s.get("kernel"):
                return s["kernel"]["execution_state"]
        return None

    def menu(self, top: str, command: str) -> None:
        """Click `top` in the menu bar, then the item that runs `command` (e.g. notebook:run-all-cells)."""
        self.page.locator("#jp-MainMenu .lm-MenuBar-item", has_text=re.compile(f"^{top}$")).click()
        self.page.locator(f'.lm-Menu-item[data-command="{command}"]').first.click()

    def toolbar(self, command: str) -> None:
        """Click the notebook toolbar's button for `command` (e.g. notebook:interrupt-kernel)."""
        self.panel.locator(f'.jp-NotebookPanel-toolbar [data-command="{command}"]').click()

    # -- cells ------------------------------------------------------------------------------------
    def code_cells(self):
        return self.panel.locator(".jp-CodeCell")

    def state(self) -> dict:
        return self.page.evaluate(STATE, PANEL)

    def source(self, i: int) -> str:
        """The code of code cell `i` as the editor shows it."""
        return self.code_cells().nth(i).locator(".cm-content").inner_text()

    def output_text(self, i: int) -> str:
        """Everything code cell `i` shows below it, as text."""
        return self.code_cells().nth(i).locator(".jp-OutputArea").inner_text()

    def stderr_texts(self) -> list[str]:
        """Every stderr (and error) output of the notebook: JupyterLab renders both with this MIME type."""
        return self.panel.locator(f".jp-OutputArea-output{STDERR}").all_inner_texts()

    def assert_ran_all(self) -> list[str]:
        """Every code cell was seen running, then got its number; no error or stderr output; the outputs."""
        st = self.state()
        assert all(st["busySeen"]), f"cells never seen running ([*]): {st['busySeen']}"
        assert all(map(executed, st["prompts"])), f"cells without an execution count: {st['prompts']}"
        counts = [int(p[1:-2]) for p in st["prompts"]]
        assert counts == sorted(set(counts)), f"execution counts out of order: {counts}"
        assert self.stderr_texts() == [], f"stderr/error output: {self.stderr_texts()}"
        return [self.output_text(i) for i in range(len(st["prompts"]))]

    def run_all(self, timeout_s: float = 300.0) -> None:
        """Clear every output (so that nothing committed is mistaken for fresh), Run All, wait until done."""
        self.menu("Edit", "editmenu:clear-all")
        self.wait_for(lambda: self.panel.locator(".jp-OutputArea-output").count() == 0, 10, "outputs cleared")
        self.menu("Run", "runmenu:run-all")
        self.wait_for(lambda: any(self.state()["busySeen"]), 30, "a cell to start")
        self.wait_for(lambda: self._settled(), timeout_s, "Run All to finish")

    def run_cell(self, i: int, wait: bool = True, timeout_s: float = 120.0) -> None:
        """Select code cell `i` and run it (Ctrl+Enter); with `wait`, until its prompt shows its number."""
        cell = self.code_cells().nth(i)
        cell.evaluate("c => { c.dataset.ddpBusySeen = '0'; }")
        cell.locator(".jp-InputPrompt").click()  # selects the cell in command mode
        self.page.keyboard.press("Control+Enter")
        self.wait_for(lambda: self.state()["busySeen"][i], 30, f"cell {i} to start")
        if wait:
            self.wait_cell(i, timeout_s)

    def run_from(self, i: int, timeout_s: float = 300.0) -> None:
        """Select code cell `i`, then Run > Run Selected Cell and All Below; wait until every cell from `i` on was
        seen running and shows its number (a kernel that dies meanwhile fails at once, as in every wait)."""
        cells = self.code_cells()
        for j in range(i, cells.count()):
            cells.nth(j).evaluate("c => { c.dataset.ddpBusySeen = '0'; }")
        cells.nth(i).locator(".jp-InputPrompt").click()  # selects the cell in command mode
        self.menu("Run", "notebook:run-all-below")
        self.wait_for(lambda: self.state()["busySeen"][i], 30, f"cell {i} to start")

        def done() -> bool:
            st = self.state()
            return all(st["busySeen"][i:]) and all(map(executed, st["prompts"][i:])) and self.kernel_state() == "idle"
        self.wait_for(done, timeout_s, f"the cells from {i} on to run")

    def wait_cell(self, i: int, timeout_s: float) -> float:
        """Wait until code cell `i` shows its execution count; the seconds it took."""
        t0 = time.monotonic()
        self.wait_for(lambda: executed(self.state()["prompts"][i]) and self.kernel_state() == "idle",
                      timeout_s, f"cell {i} to finish")
        return time.monotonic() - t0

    def _settled(self) -> bool:
        st = self.state()
        return not any("*" in p for p in st["prompts"]) and self.kernel_state() == "idle"

    def wait_for(self, ready, timeout_s: float, what: str) -> None:
        """Poll `ready()` until true; fail at once if the kernel died, else after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            dialog = self.page.evaluate("() => document.querySelector('.jp-Dialog')?.innerText || null")
            if dialog and "died" in dialog:
                raise KernelDied(f"the kernel died while waiting for {what}; JupyterLab says: {dialog!r}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}; "
                                     f"prompts: {self.state()['prompts']}")
            time.sleep(0.2)
