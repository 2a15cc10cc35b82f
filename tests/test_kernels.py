"""The kernels the package and the tests start use Unix sockets (ddp_lib.notebook.kernels): a TCP kernel binds ports
its manager chose and let go, and under the suite's load another process took one once (CI lost a run to a kernel
that died with "Address already in use")."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest

from _nbkernel import Kernel

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; Windows has no IPC")


def _listening_tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            found.add(m.group(1))
    return found


def test_a_test_kernels_channels_are_unix_sockets_and_their_folder_goes(tmp_path):
    k = Kernel(tmp_path)
    try:
        assert k.km.transport == "ipc"
        assert k.run("print(6 * 7)").stdout == "42\n"
        sockets = Path(k.km.ip).parent
        files = list(sockets.glob("k-*"))
        assert len(files) == 5 and all(stat.S_ISSOCK(f.stat().st_mode) for f in files)  # the five channels
        assert _socket_inodes(k.pid), "the kernel holds no socket at all: the check would prove nothing"
        # a TCP kernel listens on its five channels' ports (and on ipykernel's own pipe for forked subprocesses'
        # output, a port the system picks as it binds, as this one does too)
        assert len(_socket_inodes(k.pid) & _listening_tcp_inodes()) < 5
    finally:
        k.close()
    k.km.remove_sockets()
    assert not sockets.exists()


def test_a_managers_socket_folder_goes_with_it_when_nobody_removes_it():
    """nbval and nbclient never call remove_sockets(): the folder goes when the manager is collected."""
    import gc

    from jupyter_client import KernelManager

    from ddp_lib.notebook.kernels import on_ipc

    km = on_ipc(KernelManager)(kernel_name="python3")
    sockets = Path(km.ip).parent
    assert sockets.is_dir()
    del km
    gc.collect()
    assert not sockets.exists()


def test_a_lesson_run_talks_to_its_kernel_over_unix_sockets(tmp_path):
    """ddp_lib.course.tutorial.execute, which `make tutorial` and the simulated GPU runs use."""
    import nbformat

    from ddp_lib.course.tutorial import execute

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from ipykernel.kernelapp import IPKernelApp\nprint(IPKernelApp.instance().transport)")])
    nbformat.write(nb, tmp_path / "probe.ipynb")
    execute(tmp_path / "probe.ipynb", out_path=tmp_path / "out.ipynb", timeout=120)
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert out.cells[0].outputs[0]["text"] == "ipc\n"


def test_nbvals_kernels_use_unix_sockets():
    """The repository's conftest.py hands nbval a manager on IPC: the lessons' kernels, started the way nbval starts them."""
    from nbval.kernel import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:
        assert km.transport == "ipc"
        assert kc.execute_interactive("x = 1", timeout=60)["content"]["status"] == "ok"
        assert len(_socket_inodes(km.provisioner.process.pid) & _listening_tcp_inodes()) < 5
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        km.remove_sockets()


def test_the_browser_tests_lab_starts_again_when_its_port_was_taken_and_its_kernels_use_unix_sockets(tmp_path):
    """free_port() lets the lab's port go before the server binds it; here a stranger holds it already. One server
    start checks both (each costs seconds in the loaded suite)."""
    import socket

    from _lab import LabServer

    nb_dir = tmp_path / "nb"
    nb_dir.mkdir()
    server = LabServer(tmp_path, nb_dir)
    with socket.socket() as stranger:
        stranger.bind(("127.0.0.1", 0))
        stranger.listen()
        taken = stranger.getsockname()[1]
        server.port, server.url = taken, f"http://127.0.0.1:{taken}"
        server.start()
        try:
            assert server.port != taken
            kernel = server.api("POST", "/api/kernels")
            info = json.loads((server.runtime / f"kernel-{kernel['id']}.json").read_text())
            assert info["transport"] == "ipc" and info["ip"].startswith(str(server.runtime))
            assert len(info["ip"]) + len("-99999") < 107  # a Unix socket's path limit
        finally:
            leftover = server.stop()
    assert leftover == [] and not server.runtime.exists()
