"""Gloo ranks forked from a template that imported torch once, instead of fresh interpreters that each import it.

A fresh rank spends most of its start importing torch (2.9-4.1 CPU s on this 2-core VM, two days) and, at its first optimizer,
torch._dynamo (about 3 more): every rank of every `%dist_init`. This kernel's template is multiprocessing's fork
server, a fresh interpreter (never a fork of the kernel: no threads, no CUDA, no sockets) that imports them once;
each rank is a fork of it that then takes what `python -m ddp_lib.notebook._worker` would have: its own session, its
stdin on /dev/null, its stdout and stderr on the kernel's pipes, the environment and folder `%dist_init` gave it, its
thread count, `sys.argv`, multiprocessing's default start method, process name and a key of its own, a fresh seed for
numpy's global random generator (Python's `random` reseeds itself in a fork).

What it keeps of the template: whatever was read when the template started, from the kernel's environment of that
moment (PYTHONHASHSEED, so every rank hashes strings alike; PYTHONWARNINGS; OpenMP variables other than the thread
count; TORCH_LOGS), what the template imported (torch, torch._dynamo: the installed versions of that moment), and
`multiprocessing.parent_process()`, which names the template.

Only gloo ranks with no GPU are forked: a rank that may use CUDA starts as a fresh interpreter. So does every rank with
`DDP_NB_START=popen`, and every rank off Linux. Under `ddp_lib.gpusim` the ranks start the same way, as on the box it
simulates: its NCCL ranks fresh, its gloo fallbacks forked (they see no GPU, `CUDA_VISIBLE_DEVICES=""`, so the
simulation they activate when they import ddp_lib installs nothing; a template that preloaded ddp_lib, see below, would
have installed it: there they start fresh). The template does not preload the package: a rank imports ddp_lib from disk, so an edit of the package reaches the next `%dist_init`. A process has one fork server, though: had the
kernel called `ddp_lib.launch.spawn` before the first `%dist_init`, the ranks fork from that one, which preloads
ddp_lib, ddp_lib.mesh and ddp_lib.launch as well (a kernel restart reads them again). The template exits with the
kernel (when the kernel's write end of multiprocessing's "alive" pipe closes: each rank closes the one it was handed),
and its ranks with it (PR_SET_PDEATHSIG, `launch.die_with_parent`).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - its exit hook (joins children) registers before any Cluster's shutdown
import os
import subprocess
import sys
from multiprocessing.connection import Connection

from ddp_lib.devices import GPU_SIM_ENV
from ddp_lib.launch import as_fresh_process, restored_environ
from ddp_lib.notebook import _protocol as P

ENV_START = "DDP_NB_START"  # "popen": every rank starts as a fresh interpreter
# torch, what a rank imports to start (zmq, IPython's formatter and display) and what its first optimizer imports
_started = False  # this module started the fork server (not launch.spawn)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "zmq", "IPython.core.formatters", "IPython.display"]


def template(backend: str | None, gpu_ids: list[int] | None):
    """multiprocessing's fork-server context to fork this cluster's ranks from, started if it is not yet; None where
    they start as fresh interpreters (see the module's docstring)."""
    global _started
    from multiprocessing import forkserver

    if (backend != "gloo" or gpu_ids or os.environ.get(ENV_START) == "popen"
            or not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods()):
        return None
    server_pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if os.environ.get(GPU_SIM_ENV) and server_pid is not None and not _started:
        return None  # launch.spawn's server (ddp_lib preloaded, the simulated GPUs installed): not a box's template
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: a server already running keeps its own
    # if the server starts now: no GPU for it (a GPU touched before a fork is unusable in the child), and the
    # kernel's PID in its environment as in its ranks' (/proc/<pid>/environ shows what a process started with)
    with restored_environ("CUDA_VISIBLE_DEVICES", P.ENV_PARENT):
        os.environ.update({"CUDA_VISIBLE_DEVICES": "", P.ENV_PARENT: str(os.getpid())})
        forkserver.ensure_running()
    _started = True
    return ctx


class ForkedRank:
    """A rank forked from the template: the part of `subprocess.Popen` the cluster uses."""

    def __init__(self, ctx, env: dict[str, str], cwd: str) -> None:
        pipes = [os.pipe(), os.pipe()]  # stdout, stderr: read here, written by the rank
        ends = [Connection(w, readable=False) for _, w in pipes]  # sent to the fork server with the process
        try:
            self._proc = ctx.Process(target=forked_main, args=(env, cwd, *ends), name=f"ddp-nb-rank-{env['RANK']}")
            self._proc.start()
        except BaseException:
            for r, _ in pipes:
                os.close(r)
            raise
        finally:
            for end in ends:
                end.close()
        self.pid = self._proc.pid
        self.stdout, self.stderr = (open(r, "rb", buffering=0) for r, _ in pipes)  # noqa: SIM115 - the drains own them

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode  # a signal's death: minus its number, as Popen's

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank {self._proc.name}", timeout)
        return self._proc.exitcode

    # The server reaps a rank as soon as it exits, so its PID may be reused at once (a Popen's zombie holds it until
    # waited for): signal a rank only while it has not been reported gone.
    def terminate(self) -> None:
        if self.poll() is None:
            self._proc.terminate()

    def kill(self) -> None:
        if self.poll() is None:
            self._proc.kill()


def _leave_the_template() -> None:
    """Close this rank's copies of the kernel's multiprocessing descriptors and forget the kernel's helpers, as a fresh
    interpreter would not know them: the write end of the fork server's "alive" pipe and the resource tracker's pipe,
    which multiprocessing hands to every child of the server.

    Held by the ranks, the "alive" pipe kept the template alive after the kernel died, and so the ranks, which die with
    the template (PR_SET_PDEATHSIG): they outlived a SIGKILLed kernel (test_6). A rank that starts processes of its own
    (`ddp_lib.launch.spawn`, a DataLoader's workers) starts its own helpers, as a fresh one does.
    """
    from multiprocessing import forkserver, resource_tracker

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        os.close(fd)
        for name in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds"):
            if hasattr(server, name):
                setattr(server, name, None)
    tracker = getattr(resource_tracker, "_resource_tracker", None)
    fd = getattr(tracker, "_fd", None)
    if fd is not None:
        os.close(fd)
        tracker._fd = tracker._pid = None


def forked_main(env: dict[str, str], cwd: str, stdout: Connection, stderr: Connection) -> None:
    """In the forked rank: become what `python -m ddp_lib.notebook._worker` started by the kernel would be, then run."""
    _leave_the_template()
    # the cluster's environment (not the kernel's when the template started), its thread count, numpy's own seed, and
    # what the template imported kept out of the cyclic collector's scans
    threads = env.get("OMP_NUM_THREADS", "")
    as_fresh_process(env, int(threads) if threads.isdigit() else None)
    os.setsid()  # as Popen(start_new_session=True): Jupyter's interrupt reaches the kernel, which forwards it
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (stdout.fileno(), 1), (stderr.fileno(), 2)):
        os.dup2(fd, target)
    os.close(null)
    stdout.close()
    stderr.close()
    sys.stdout = open(1, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    os.chdir(cwd)
    mp.set_start_method(None, force=True)  # the platform's default again, not the fork server that started us
    me = mp.current_process()  # a main process of its own, as a fresh rank is (parent_process() still names the server)
    me.name, me.authkey = "MainProcess", os.urandom(32)
    from ddp_lib.notebook import _worker

    sys.argv = [_worker.__file__]  # as `python -m` sets it (multiprocessing's preparation gave us the kernel's)
    _worker.main()
