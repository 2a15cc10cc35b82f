"""Drive a real IPython kernel (this venv's interpreter) for the ddp_lib.notebook tests.

Which magics run is chosen by $DDP_NB_UNDER_TEST (default `ddp_lib.notebook`). With
`DDP_NB_UNDER_TEST=nbdistributed`, every `%load_ext ddp_lib.notebook` sent to a kernel (through
`Kernel.run`, or `under_test()` for code sent another way) loads vanilla nbdistributed 0.1.0 instead,
so the regression tests can be shown to fail on the unfixed library. Vanilla's workers carry no
DDP_NB_PARENT_PID, so in that mode every process seen below the kernel (parent-PID links in /proc)
is remembered with its start time and ended at `Kernel.close()` by PID: SIGTERM, then SIGKILL.
Never by name: vanilla's `%dist_reset` kills by name pattern, so the tests skip it in that mode.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

from ddp_lib.launch import descendants  # noqa: F401 - the tests take it from here
from ddp_lib.notebook.kernels import on_ipc

KERNEL_NAME = "ddp-nb-test"
UNDER_TEST = os.environ.get("DDP_NB_UNDER_TEST", "ddp_lib.notebook")
VANILLA = UNDER_TEST == "nbdistributed"


def under_test(code: str) -> str:
    """`code` with the extension under test loaded in place of ddp_lib.notebook."""
    return code.replace("%load_ext ddp_lib.notebook", f"%load_ext {UNDER_TEST}")


def kernelspec_dir(root: Path) -> Path:
    """A kernelspec whose argv is exactly this interpreter (no `python` looked up on PATH)."""
    d = root / "kernels" / KERNEL_NAME
    d.mkdir(parents=True, exist_ok=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "ddp_lib test", "language": "python"}
    (d / "kernel.json").write_text(json.dumps(spec))
    return root / "kernels"


def kernel_manager(root: Path, cwd: Path, env: dict | None = None) -> KernelManager:
    ksm = KernelSpecManager(kernel_dirs=[str(kernelspec_dir(root))])
    km = on_ipc(KernelManager)(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)  # no TCP port to race for
    base = {k: v for k, v in os.environ.items() if k != "DDP_NB_LIVE_AFTER_S"}  # the magics' own default
    km.start_kernel(cwd=str(cwd), env={**base, **(env or {})})
    return km


@dataclass
class Reply:
    status: str
    outputs: list = field(default_factory=list)  # iopub messages (stream/display/execute_result/error)
    elapsed: float = 0.0
    first_output_t: float | None = None  # seconds after sending, of the first stream message
    cleared: int = 0  # clear_output messages seen (a client like nbval would not apply them)
    execution_count: int | None = None  # the number the notebook shows beside the cell

    @property
    def stdout(self) -> str:
        return "".join(m["content"]["text"] for m in self.outputs
                       if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(m["content"]["text"] for m in self.outputs
                       if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")

    @property
    def text(self) -> str:
        """Everything shown, in order, as text."""
        parts = []
        for m in self.outputs:
            c = m["content"]
            if m["msg_type"] == "stream":
                parts.append(c["text"])
            elif m["msg_type"] in ("display_data", "execute_result"):
                parts.append(c["data"].get("text/plain", "") + "\n")
            elif m["msg_type"] == "error":
                parts.append(f"{c['ename']}: {c['evalue']}\n" + "\n".join(c["traceback"]) + "\n")
        return "".join(parts)

    def of_type(self, t: str) -> list:
        return [m["content"] for m in self.outputs if m["msg_type"] == t]


class Kernel:
    """A started kernel plus a blocking client; `run(code)` returns a Reply."""

    def __init__(self, root: Path, cwd: Path | None = None, env: dict | None = None) -> None:
        self.km = kernel_manager(root, cwd or root, env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.pid = self.km.provisioner.process.pid
        self._known_workers: set[int] = set()
        self._kernel_pids: set[int] = {self.pid}
        self._seen: dict[int, int] = {}  # every descendant seen: PID -> start time (vanilla mode)

    def run(self, code: str, timeout: float = 60.0, on_sent=None, on_output=None) -> Reply:
        """Execute `code`; `on_sent()` runs once it is sent, `on_output()` at its first stream message."""
        msg_id = self.kc.execute(under_test(code))
        t0 = time.monotonic()
        if on_sent:
            on_sent()
        reply = Reply(status="?")
        deadline = t0 + timeout
        idle = False
        while not idle:
            msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            t = msg["msg_type"]
            if t == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
            elif t in ("stream", "display_data", "execute_result", "error", "clear_output", "update_display_data"):
                if t == "clear_output":
                    reply.outputs.clear()  # what a notebook keeps (wait=True clears before the next output)
                    reply.cleared += 1
                    continue
                if t == "stream" and reply.first_output_t is None:
                    reply.first_output_t = time.monotonic() - t0
                    if on_output:
                        on_output()
                reply.outputs.append(msg)
        while True:
            shell = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
            if shell["parent_header"].get("msg_id") == msg_id:
                break
        reply.status = shell["content"]["status"]
        reply.execution_count = shell["content"].get("execution_count")
        reply.elapsed = time.monotonic() - t0
        self.remember_workers()
        return reply

    def remember_workers(self) -> None:
        self._kernel_pids.add(self.pid)
        self.worker_pids()

    def worker_pids(self) -> list[int]:
        """The processes below the kernel, less its multiprocessing helpers (`kernel_helpers`)."""
        pids = descendants(self.pid)
        self._known_workers |= set(pids)
        self._seen.update(start_times(pids))
        helpers = kernel_helpers(self.pid, pids)
        return [p for p in pids if p not in helpers]

    def close(self) -> None:
        """Shut the kernel down, then make sure nothing it started is left (each ended by PID)."""
        self.remember_workers()
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)
        except Exception:  # noqa: BLE001
            pass
        if VANILLA:  # its workers carry no DDP_NB_PARENT_PID: end each process seen below the kernel
            end_pids(self._seen)
        else:
            kill_pids(self._known_workers, parents=self._kernel_pids | {self.pid})


def kernel_helpers(pid: int, below: list[int] | None = None) -> set[int]:
    """The children of kernel `pid` that outlive its ranks by design: multiprocessing's fork server, which its gloo
    ranks are forked from (ddp_lib.notebook._fork), and the resource tracker started with it. A rank forked from the
    server has the server's command line too, but the server, not the kernel, as its parent. `below`: the kernel's
    descendants when the caller has read them already (else read here)."""
    out = set()
    for p in descendants(pid) if below is None else below:
        try:
            parent = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if parent == pid and (b"multiprocessing.forkserver" in cmdline or b"multiprocessing.resource_tracker" in cmdline):
            out.add(p)
    return out


def start_times(pids) -> dict[int, int]:
    """PID -> start time (clock ticks after boot, /proc/<pid>/stat field 22): tells a reused PID apart."""
    out = {}
    for p in pids:
        try:
            out[p] = int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[19])
        except (OSError, ValueError, IndexError):
            pass
    return out


def end_pids(seen: dict[int, int], grace: float = 3.0) -> None:
    """SIGTERM each process of `seen` (PID -> start time) still alive and the same; SIGKILL it after `grace` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        same = start_times(seen)
        left = [p for p, t in seen.items() if same.get(p) == t and alive(p)]
        for p in left:
            try:
                os.kill(p, sig)
            except OSError:
                pass
        if not wait_gone(left, grace):
            return


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# What a process that must end gets before the test calls it left behind (a parent-death signal, a kernel tearing
# its ranks down): on the 2-core VM loaded by other jobs it once took over 10 s. An orphan for good still fails it.
GONE_S = 30.0


def wait_gone(pids, timeout: float = GONE_S) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def kill_pids(pids, parents: set[int] | None = None) -> None:
    """SIGKILL each PID still alive; with `parents`, only workers those kernels started (PID reuse)."""
    for p in pids:
        if parents is not None:
            try:
                env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if not any(f"DDP_NB_PARENT_PID={k}".encode() in env for k in parents):
                continue
        if alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
