"""ddp_lib.launch: ranks never outlive the process that spawned them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has already exited
    except FileNotFoundError:
        return False


def test_ranks_die_when_their_parent_is_killed(tmp_path: Path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import os, time
        from ddp_lib.launch import spawn

        def hang(folder):
            open(os.path.join(folder, str(os.getpid())), "w").close()
            time.sleep(600)  # as if stuck in a collective

        if __name__ == "__main__":
            spawn(hang, world_size=2, args=({str(tmp_path)!r},), timeout_s=600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
            time.sleep(0.2)
        assert len(pids) == 2, "the ranks did not start"
        parent.send_signal(signal.SIGKILL)  # no atexit, no finally: only the ranks' own guard can act
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), "ranks outlived their SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in pids:  # only the processes this test started, by PID
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _sum_of_ones() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def _fails_like_the_network() -> None:
    raise RuntimeError("Connection reset by peer")  # from fn itself: never a reason to start the ranks again


def _ports(monkeypatch, first: int) -> None:
    """launch.free_port gives `first`, then free ports."""
    from ddp_lib import launch

    real, given = launch.free_port, [first]
    monkeypatch.setattr(launch, "free_port", lambda: given.pop() if given else real())


def test_a_port_taken_before_the_ranks_meet_starts_them_again_on_another(monkeypatch, capsys):
    import socket

    from ddp_lib.launch import spawn

    with socket.socket() as taken:  # free_port closes its probe socket: another process may bind the port meanwhile
        taken.bind(("127.0.0.1", 0))
        taken.listen(8)
        port = taken.getsockname()[1]
        _ports(monkeypatch, port)
        assert spawn(_sum_of_ones, 2, timeout_s=60) == [2.0, 2.0]
    err = capsys.readouterr().err
    assert f"could not meet on port {port}" in err and "starting them again" in err, err


@pytest.mark.parametrize("fn, backend", [(_sum_of_ones, "no_such_backend"), (_fails_like_the_network, "gloo")],
                         ids=["init-error-not-of-the-network", "fn-raised-a-network-error"])
def test_other_failures_are_reported_at_once_not_retried(fn, backend, capsys):
    from ddp_lib.launch import RankError, spawn

    with pytest.raises(RankError):
        spawn(fn, 2, backend=backend, timeout_s=60)
    assert "starting them again" not in capsys.readouterr().err


def _fast_rank_still_there_when_the_slow_one_ends() -> bool | None:
    """Rank 1 returns at once; rank 2 sleeps, then looks whether rank 1's process is still alive (rank 0, the store
    host, has always waited). A rank that left at once could close its gloo connections under a slower peer still
    making them at init: "Connection closed by peer" there, seen in CI."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    store, rank = c10d._get_default_store(), dist.get_rank()
    if rank == 1:
        store.set("pid1", str(os.getpid()))
    if rank != 2:
        return None
    time.sleep(1.5)
    return _alive(int(store.get("pid1")))


def test_no_rank_leaves_before_its_peers_are_done():
    from ddp_lib.launch import spawn

    assert spawn(_fast_rank_still_there_when_the_slow_one_ends, 3, timeout_s=60)[2] is True


def _what_a_fresh_process_has() -> tuple[int, str | None, int]:
    import numpy as np
    import torch

    return int(np.random.randint(2**62)), os.environ.get("LAUNCH_PROBE"), torch.get_num_threads()


def test_each_rank_starts_as_a_fresh_process_would(monkeypatch):
    """Forked from a template that imported torch (and numpy, whose global generator was seeded once there), each
    rank still draws its own numpy numbers, sees the caller's environment as it is at the call, and runs the threads it
    was given."""
    from ddp_lib.launch import _context, spawn

    if _context().get_start_method() != "forkserver":
        pytest.skip("ranks start from scratch here (no fork server): nothing inherited to check")
    monkeypatch.setenv("LAUNCH_PROBE", "first")
    first = spawn(_what_a_fresh_process_has, 2, timeout_s=60, threads=1)
    monkeypatch.setenv("LAUNCH_PROBE", "second")
    second = spawn(_what_a_fresh_process_has, 2, timeout_s=60, threads=2)
    draws = [d for d, _, _ in first + second]
    assert len(set(draws)) == 4, f"ranks drew the same numpy numbers: {draws}"
    assert [(e, t) for _, e, t in first + second] == [("first", 1)] * 2 + [("second", 2)] * 2
