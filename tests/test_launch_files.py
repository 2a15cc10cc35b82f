"""The launch files' rendezvous check: a c10d endpoint another program holds stops torchrun.sh with the reason, where
torchrun alone waits forever; a free port and a real c10d store pass it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ddp_lib.launch import free_port
from ddp_lib.notebook._launch_files import write_launch_files
from ddp_lib.notebook._rdzv_probe import endpoint_problem

HELD = "is held by another program, not a c10d store"


class Holder:
    """A program that is not a store on a port of its own: it accepts connections and never answers (`close_at_once`:
    it closes each one)."""

    def __init__(self, close_at_once: bool = False) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.close_at_once, self.conns = close_at_once, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            conn.close() if self.close_at_once else self.conns.append(conn)

    def close(self) -> None:
        """Close the listening socket and every connection it kept (a waiting client's read then ends)."""
        for c in [*self.conns, self.sock]:
            c.close()


@pytest.fixture
def holder():
    h = Holder()
    yield h
    h.close()


def test_free_port_and_a_real_store_pass():
    assert endpoint_problem("127.0.0.1", free_port(), wait_s=5) is None  # refused: a node will host the store there
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    assert endpoint_problem("127.0.0.1", store.port, wait_s=10) is None  # another node's store, already up


def test_a_silent_program_is_named_within_the_wait(holder):
    problem = endpoint_problem("127.0.0.1", holder.port, wait_s=1)
    assert problem and HELD in problem and "did not answer a c10d store's ping within 1 s" in problem, problem


def test_a_program_that_hangs_up_is_named():
    h = Holder(close_at_once=True)
    try:
        problem = endpoint_problem("127.0.0.1", h.port, wait_s=4)
    finally:
        h.close()
    assert problem and HELD in problem and "failed a c10d store's handshake (DistNetworkError" in problem, problem


def test_torchrun_sh_stops_on_a_held_port_before_torchrun_starts(holder, tmp_path):
    """The generated multi-node launch, pointed at the held port: without the check torchrun waits there for good
    (the subprocess limit below would end the test); with it the script ends with the named error."""
    script = tmp_path / "train.py"
    script.write_text("print('the script ran')\n")
    [sh, _] = write_launch_files(script)
    env = dict(os.environ, NNODES="1", NPROC="1", RDZV_HOST="127.0.0.1", RDZV_PORT=str(holder.port),
               RDZV_PROBE_S="2", PYTHON=sys.executable,
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    r = subprocess.run(["bash", str(sh), "many"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)
    assert (f"RendezvousEndpointError: rendezvous endpoint 127.0.0.1:{holder.port} {HELD}: it accepted a connection "
            "but did not answer a c10d store's ping within 2 s; torchrun would wait there forever") in r.stderr, r.stderr
    assert "the script ran" not in r.stdout
