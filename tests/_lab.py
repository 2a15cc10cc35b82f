"""A private JupyterLab server for the browser tests, and the kernel-side bookkeeping around it.

The server binds 127.0.0.1 on a free port with a random token (another one if that port was taken meanwhile); its
kernels talk over Unix sockets (no port to race for); its runtime, config, data, settings,
workspace and IPython directories live in temp dirs, so nothing of the user's lab (open tabs,
extensions' settings, kernelspecs) leaks in and nothing is written back. It is stopped by PID after
its kernels were shut down through its REST API, and every process it started is checked to be gone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from _nbkernel import alive, end_pids, start_times

from ddp_lib.launch import descendants, free_port

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
ENV_CHROMIUM = "DDP_CHROMIUM"  # a browser binary to use instead of the one found on PATH
ENV_REQUIRED = "DDP_BROWSER_TESTS_REQUIRED"  # set by CI: a missing Chromium fails instead of skipping
GRACE_S = 3  # DDP_NB_GRACE of the lab's kernels: how long an interrupted rank gets before it is killed

# User settings of the private lab: no autosave (the copies stay as copied), every cell attached to
# the DOM (the default windowing skips off-screen cells, which the DOM checks must see), no news.
SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"checkForUpdates": False, "fetchNews": "false"},
}


def chromium_path() -> str | None:
    """Debian's Chromium (`apt-get install chromium`), or $DDP_CHROMIUM; None when there is none."""
    if os.environ.get(ENV_CHROMIUM):
        path = os.environ[ENV_CHROMIUM]
        return path if os.access(path, os.X_OK) else None
    return next(filter(None, map(shutil.which, CHROMIUM_NAMES)), None)


class LabServer:
    """`jupyter lab` serving `notebook_dir`, everything else private to `root`."""

    def __init__(self, root: Path, notebook_dir: Path, extra_args: list[str] | None = None) -> None:
        self.root, self.notebook_dir = root, notebook_dir
        self.extra_args = list(extra_args or [])  # further `jupyter lab` options (e.g. `make lab`'s)
        self.port = free_port()
        self.token = secrets.token_hex(24)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / "server.log"
        self.runtime: Path | None = None  # a private runtime dir per start (_start)
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, int] = {}  # every process seen below the server: PID -> start time

    def _env(self) -> dict[str, str]:
        dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data",
                "JUPYTERLAB_SETTINGS_DIR": "settings", "JUPYTERLAB_WORKSPACES_DIR": "workspaces",
                "IPYTHONDIR": "ipython"}
        env = {k: v for k, v in os.environ.items()
               # what pytest sets for nbval, not what a learner has: the live view and the inline backend
               if k not in ("DDP_NB_LIVE_AFTER_S", "MPLBACKEND", "JUPYTER_PATH")}
        env.update({k: str(self.root / d) for k, d in dirs.items()})
        env["JUPYTER_RUNTIME_DIR"] = str(self.runtime)
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   DDP_NB_GRACE=str(GRACE_S), PYTHONUNBUFFERED="1")
        return env

    def _write_config(self, env: dict[str, str]) -> None:
        for name, values in SETTINGS.items():
            path = Path(env["JUPYTERLAB_SETTINGS_DIR"]) / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        # the notebooks' "python3" kernel is exactly this interpreter (the user data dir comes first)
        spec = Path(env["JUPYTER_DATA_DIR"]) / "kernels" / "python3"
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (ipykernel)", "language": "python"}))

    def start(self, timeout_s: float = 120.0, tries: int = 3) -> None:
        """Start the server and return once its API answers. free_port() lets its port go before the server binds
        it: if another process took it meanwhile, the server starts again on another one."""
        chosen = any(a.split("=", 1)[0] in ("--ServerApp.port", "--port") for a in self.extra_args)
        for _ in range(tries - 1):
            try:
                return self._start(timeout_s)
            except RuntimeError as e:
                # jupyter_server says "already in use" (INFO or WARNING), then "is not available" (CRITICAL)
                if chosen or not any(m in str(e).lower() for m in ("already in use", "is not available")):
                    raise
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        return self._start(timeout_s)

    def _start(self, timeout_s: float) -> None:
        # the kernels' connection files, and their socket files named after them (kernel-<uuid>-ipc-N): a fresh folder
        # per start, under /tmp whatever $TMPDIR is, since a Unix socket's path has at most 107 bytes (104 on macOS)
        self.runtime = Path(tempfile.mkdtemp(prefix="ddp_lab_", dir="/tmp" if os.path.isdir("/tmp") else None))
        env = self._env()
        self._write_config(env)
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0", "--KernelManager.transport=ipc",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.notebook_dir}"]
        # an option given twice is an error to jupyter: extra_args replace the defaults they name
        given = {a.split("=", 1)[0] for a in self.extra_args}
        cmd = [a for a in cmd if a.split("=", 1)[0] not in given] + self.extra_args
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.notebook_dir, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                shutil.rmtree(self.runtime, ignore_errors=True)
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status", timeout=2)  # short: a stranger on the port may never answer
                return
            except (OSError, urllib.error.URLError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"jupyter lab did not answer within {timeout_s:g} s:\n{self.log_tail()}")

    def api(self, method: str, path: str, timeout: float = 30) -> Any:
        """One REST call with the token; the decoded JSON reply (None when empty)."""
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def scratch(self, name: str, cells: list[str]) -> str:
        """A notebook of code `cells` written next to the lessons; its path for LabPage.open."""
        import nbformat

        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
        (self.notebook_dir / "scratch").mkdir(exist_ok=True)
        nbformat.write(nb, self.notebook_dir / "scratch" / name)
        return f"scratch/{name}"

    def lab_url(self, workspace: str, path: str) -> str:
        """`path` opened in its own, empty workspace: no tab of an earlier test is restored beside it."""
        return f"{self.url}/lab/workspaces/{workspace}/tree/{path}?token={self.token}"

    def remember(self) -> list[int]:
        """The processes below the server now (kernels, their ranks); remembered for stop()."""
        pids = descendants(self.proc.pid) if self.proc else []
        self.seen.update(start_times(pids))
        return pids

    def shutdown_kernels(self, timeout_s: float = 20.0) -> list[int]:
        """Shut every kernel down through the API; the PIDs of processes still below the server after."""
        self.remember()
        for k in self.api("GET", "/api/kernels"):
            try:
                self.api("DELETE", f"/api/kernels/{k['id']}")
            except urllib.error.HTTPError:
                pass  # gone meanwhile (a restart, a dead kernel)
        deadline = time.monotonic() + timeout_s
        while (left := [p for p in descendants(self.proc.pid) if alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def stop(self) -> list[int]:
        """Kernels down through the API, the server stopped by PID; the PIDs that had to be killed."""
        if self.proc is None:
            return []
        try:
            self.shutdown_kernels()
        except (OSError, urllib.error.URLError):
            pass  # the server is not answering: it is stopped below all the same
        self.remember()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        same = start_times(self.seen)
        leftover = [p for p, t in self.seen.items() if same.get(p) == t and alive(p)]
        end_pids(self.seen)
        self.proc = None
        if self.runtime is not None:
            shutil.rmtree(self.runtime, ignore_errors=True)
        return leftover

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the server's log (kernel starts, restarts, deaths)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no server log)"


def copy_notebooks(src: Path, dst: Path) -> Path:
    """The lessons (and the assets their markdown shows) copied to `dst`: the committed files stay untouched."""
    (dst / "notebooks").mkdir(parents=True)
    for nb in src.glob("*.ipynb"):
        shutil.copy2(nb, dst / "notebooks" / nb.name)
    assets = src.parent / "assets"
    if assets.is_dir():
        shutil.copytree(assets, dst / "assets")
    return dst / "notebooks"
