"""The kernel's side: start the ranks, keep their PIDs, talk to them, and end them (by PID only)."""

from __future__ import annotations

import atexit
import codecs
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

import zmq

from ddp_lib.launch import free_port, rendezvous_failure
from ddp_lib.notebook import _protocol as P
from ddp_lib.notebook._devices import worker_visible_devices
from ddp_lib.notebook._fork import ForkedRank, template


class WorkerStartError(RuntimeError):
    """A rank failed to start or to join the process group; `rendezvous`: the reason, when it was the network's
    (`launch.RENDEZVOUS`), else None."""

    def __init__(self, message: str, rendezvous: str | None = None) -> None:
        super().__init__(message)
        self.rendezvous = rendezvous


class Cluster:
    """`n` worker processes of this kernel, reachable over a loopback ROUTER socket."""

    def __init__(self, n: int, gpu_ids: list[int] | None = None, master_addr: str = "127.0.0.1",
                 master_port: int | None = None, start_timeout_s: float = 180.0, backend: str | None = None) -> None:
        self.n = n
        self.gpu_ids = gpu_ids
        self.backend = "nccl" if gpu_ids else backend  # None: each rank's ddp_lib.mesh.pick_backend decides
        self.token = P.new_token()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MSG_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")  # loopback only, never 0.0.0.0
        self.identity: dict[int, bytes] = {}
        self.rank_of: dict[bytes, int] = {}
        self.status: dict[int, dict[str, Any]] = {}
        self.procs: list[subprocess.Popen | ForkedRank] = []
        self._drains: list[threading.Thread] = []  # the threads reading the ranks' pipes
        self.stray: dict[int, deque] = {r: deque() for r in range(n)}  # fd-level output, drained by threads
        self.rejected = 0
        self.broken: str | None = None  # why the ranks can no longer run cells together
        self.cell_seq = 0
        self.cell_names: set[str] = set()  # traceback file names given so far (see _execute.cell_name)
        atexit.register(self.shutdown, 0.0)
        try:
            self._start(master_addr, master_port, start_timeout_s)
        except BaseException:
            self.shutdown(0.0)
            raise

    # -- start ------------------------------------------------------------------------------------
    def _start(self, master_addr: str, master_port: int | None, timeout_s: float) -> None:
        """Start the ranks and wait for each one's hello. Ranks that could not meet for a reason of the network
        (`launch.RENDEZVOUS`: the port free_port() chose was taken before rank 0's store bound it) are started
        once more on another port, saying so on stderr, as `launch.spawn` does; a port the caller named is kept."""
        port = master_port or free_port()
        try:
            self._spawn(master_addr, port)
            self._await_hello(timeout_s)
        except WorkerStartError as e:
            if master_port is not None or not e.rendezvous:
                raise
            print(f"%dist_init: the ranks could not meet on port {port} ({e.rendezvous}); starting them again on "
                  "another port", file=sys.stderr, flush=True)
            self._stop_ranks()
            self._spawn(master_addr, free_port())
            self._await_hello(timeout_s)

    def _spawn(self, master_addr: str, master_port: int) -> None:
        cwd = os.getcwd()
        syspath = [cwd] + [p for p in sys.path if p and os.path.isdir(p)]
        base = dict(os.environ)
        base.update({
            "WORLD_SIZE": str(self.n), "LOCAL_WORLD_SIZE": str(self.n), "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port), P.ENV_PORT: str(self.port), P.ENV_TOKEN: self.token.decode(),
            P.ENV_PARENT: str(os.getpid()), P.ENV_SYSPATH: os.pathsep.join(syspath),
            # PR_SET_PDEATHSIG fires when the *thread* that forked exits: only safe from the main thread
            P.ENV_PDEATHSIG: "1" if threading.current_thread() is threading.main_thread() else "0",
            "PYTHONUNBUFFERED": "1", "MPLBACKEND": "module://ddp_lib.notebook._mpl_backend",
        })
        base.pop("TORCHELASTIC_RUN_ID", None)
        # rank r sees gpu_ids[r] as cuda:r, so LOCAL_RANK indexes it (ddp_lib.mesh); gloo ranks see no GPU at all
        if self.gpu_ids or self.backend == "gloo":
            base["CUDA_VISIBLE_DEVICES"] = worker_visible_devices(self.gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if self.backend:
            base[P.ENV_BACKEND] = self.backend
        if "OMP_NUM_THREADS" not in os.environ:  # n ranks share the cores, no oversubscription
            base["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.n))
        fork = template(self.backend, self.gpu_ids)  # None: fresh interpreters (see _fork)
        if fork is not None:
            base[P.ENV_PDEATHSIG] = "1"  # the template forks from its main thread
        for r in range(self.n):
            env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
            if self.gpu_ids:
                env[P.ENV_GPU_ID] = str(self.gpu_ids[r])
            p = ForkedRank(fork, env, cwd) if fork is not None else subprocess.Popen(
                [sys.executable, "-m", "ddp_lib.notebook._worker"], cwd=cwd, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,  # Jupyter's interrupt signals the kernel's group; we forward it
            )
            self.procs.append(p)
            for stream, pipe in (("stdout", p.stdout), ("stderr", p.stderr)):
                t = threading.Thread(target=self._drain, args=(r, stream, pipe), daemon=True,
                                     name=f"ddp-nb-drain-{r}-{stream}")
                t.start()
                self._drains.append(t)

    def _drain(self, rank: int, stream: str, pipe) -> None:
        """Read a worker's raw fd output forever, so the worker never blocks on a full pipe.

        The worker writes an end-of-cell mark to both fds before it reports a cell done; the mark
        becomes a ("mark", cell) entry, so the kernel knows it has all of that cell's fd output.
        """
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        fd, held = pipe.fileno(), ""
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                chunk = b""
            text = held + dec.decode(chunk, final=not chunk)
            pos = 0
            for m in P.FD_MARK.finditer(text):
                if m.start() > pos:
                    self.stray[rank].append((stream, text[pos:m.start()]))
                self.stray[rank].append(("mark", (stream, int(m.group(1)))))
                pos = m.end()
            text = text[pos:]
            cut = text.rfind("\x00")  # a mark may be split across reads: hold its beginning back
            held = text[cut:] if chunk and cut >= 0 and len(text) - cut < 40 else ""
            text = text[: len(text) - len(held)]
            if text:
                self.stray[rank].append((stream, text))
            if not chunk:
                return

    def _await_hello(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        errors: dict[int, str] = {}
        network = None  # why the ranks could not meet, when it was the network's (launch.RENDEZVOUS)
        while len(self.identity) + len(errors) < self.n and network is None:
            for r, p in enumerate(self.procs):
                if p.poll() is not None and r not in self.identity and r not in errors:
                    time.sleep(0.2)  # let the drain threads collect its last words
                    errors[r] = f"rank {r} exited with code {p.returncode}\n{self.take_stray(r)}"
            if time.monotonic() > deadline:
                for r in set(range(self.n)) - self.identity.keys() - errors.keys():
                    errors[r] = f"rank {r} did not report ready within {timeout_s:.0f} s\n{self.take_stray(r)}"
            else:
                for ident, msg in self.recv(100):
                    if msg.get("kind") != "hello":
                        continue
                    r = msg["rank"]
                    if msg.get("ok"):
                        self.identity[r], self.rank_of[ident] = ident, r
                        self.status[r] = msg["status"]
                    else:
                        errors[r] = msg.get("error", "")
            network = next((why for e in errors.values() if (why := rendezvous_failure(e))), None)
        if network:  # the others wait on a store that is not ours (or on nothing): no point waiting for them
            for r in set(range(self.n)) - self.identity.keys() - errors.keys():
                errors[r] = f"rank {r}: not waited for, the ranks could not meet ({network})\n"
        if errors:
            report = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
            raise WorkerStartError(f"{len(errors)} of {self.n} ranks failed to start:\n{report}", network)

    def _stop_ranks(self) -> None:
        """End the ranks of a start that failed (each by its PID) and forget them: the next start begins clean."""
        self.kill(range(len(self.procs)))
        for t in self._drains:  # their pipes close with the processes
            t.join(timeout=2.0)
        self.procs, self._drains = [], []
        self.token = P.new_token()  # a late message of the ended ranks fails authentication and is dropped
        self.identity.clear()
        self.rank_of.clear()
        self.status.clear()
        self.stray = {r: deque() for r in range(self.n)}

    # -- messages ---------------------------------------------------------------------------------
    def recv(self, timeout_ms: int) -> list[tuple[bytes, dict[str, Any]]]:
        """Every authentic message available within `timeout_ms`; anything else is dropped unread."""
        out = []
        if not self.sock.poll(timeout_ms):
            return out
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            body = P.unpack(self.token, frames[1:]) if len(frames) == 3 else None
            known = frames[0] in self.rank_of or (body is not None and body.get("kind") == "hello")
            if body is None or not known:
                self.rejected += 1
                continue
            out.append((frames[0], body))

    def send(self, rank: int, body: dict[str, Any]) -> None:
        self.sock.send_multipart([self.identity[rank], *P.pack(self.token, body)])

    def take_stray(self, rank: int) -> str:
        q, parts = self.stray[rank], []
        while q:
            kind, text = q.popleft()
            if kind != "mark":
                parts.append(text)
        return "".join(parts)

    def request(self, op: str, ranks: list[int] | None = None, timeout_s: float = 30.0) -> dict[int, dict]:
        """Send a small command and collect the replies (status, sync)."""
        ranks = list(range(self.n)) if ranks is None else ranks
        replies: dict[int, dict] = {}
        try:
            for r in ranks:
                self.send(r, {"op": op})
            deadline = time.monotonic() + timeout_s
            while len(replies) < len(ranks) and time.monotonic() < deadline:
                for ident, msg in self.recv(50):
                    # a late reply to an earlier request (another op) is not this one's answer
                    if msg.get("kind") == "done" and msg.get("cell") is None and msg.get("op") == op:
                        replies[self.rank_of[ident]] = msg
        finally:
            missing = sorted(set(ranks) - replies.keys())
            if missing and op == "sync" and not self.broken:  # interrupted or timed out: a rank may still
                self.broken = f"rank(s) {missing} did not answer {op!r}"  # be inside it (a barrier), unable to run cells
        return replies

    # -- processes --------------------------------------------------------------------------------
    def _wait_exit(self, seconds: float) -> None:
        """Wait up to `seconds` for every rank to exit."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.02)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def alive(self, rank: int) -> bool:
        return self.procs[rank].poll() is None

    def interrupt(self, ranks) -> None:
        for r in ranks:
            if self.alive(r):
                os.kill(self.procs[r].pid, signal.SIGINT)

    def kill(self, ranks) -> None:
        for r in ranks:
            p = self.procs[r]
            if p.poll() is None:
                p.kill()
            p.wait()

    def shutdown(self, grace_s: float = 3.0) -> None:
        """Ask the ranks to exit, then terminate and kill the ones still there, each by its own PID.

        A stop pressed meanwhile (KeyboardInterrupt in the waits) cuts the waiting short, never the ending: the ranks
        still there are killed at once, so a stopped `%dist_shutdown` leaves no rank behind and no half-shut cluster."""
        atexit.unregister(self.shutdown)
        try:
            if grace_s > 0:
                for r in list(self.identity):
                    if self.alive(r):
                        try:
                            self.send(r, {"op": "shutdown"})
                        except zmq.ZMQError:
                            pass
                self._wait_exit(grace_s)
            for p in self.procs:
                if p.poll() is None:
                    p.terminate()
            self._wait_exit(1.0)
        except KeyboardInterrupt:
            print("stopped while the ranks were ending: killing the ones left", file=sys.stderr, flush=True)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.broken = self.broken or "shut down"
        self.sock.close(0)
        self.ctx.term()
