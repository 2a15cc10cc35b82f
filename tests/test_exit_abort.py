"""The exit-time abort of CS336 2025's DDP tests: a rank ending with SIGABRT ("terminate called without an active
exception") after `barrier(); destroy_process_group()` and a normal return, seen while another process loaded the
cores. `tests/exit_abort_cases.py` is the harness (spawned gloo ranks, every engine behind an adapter, each rank's
exit code read).

An engine must not keep its process group alive past `destroy_process_group()`: a group still referenced keeps its
gloo threads until interpreter shutdown, where ending them can abort the process. That release is checked
deterministically; the loaded reproducer runs `EXIT_ABORT_RUNS` jobs (3 by default, 30 by hand).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("exit_abort_cases.py")
RUNS = int(os.environ.get("EXIT_ABORT_RUNS", "3"))
sys.path.insert(0, str(SCRIPT.parent))


def _run(*args: str, timeout: float) -> list[str]:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()


@pytest.mark.parametrize("given", [False, True], ids=["default-group", "given-group"])
def test_destroy_frees_the_group_an_engine_holds(given):
    # a fresh interpreter per case: which module imported torch.distributed.nn.functional first decides whether
    # its default arguments hold the default group (tests/test_teardown.py)
    lines = _run("--freed", *(["--group"] if given else []), timeout=180)
    assert lines == ["naive freed", "flat freed", "overlap freed", "bucketed freed", "fsdp freed", "hsdp freed"], lines


def test_an_engine_on_a_destroyed_group_says_so():
    import torch.distributed as dist
    import torch.nn as nn

    from ddp_lib.ddp import BucketedDDP

    from ddp_lib.fsdp import FSDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = BucketedDDP(nn.Linear(2, 2), process_group=dist.new_group([0]))
        fsdp = FSDP(nn.Linear(2, 2), process_group=dist.new_group([0]))
    finally:
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="process group was destroyed"):
        ddp.process_group
    for part in (fsdp._comm, fsdp._guards, fsdp._states):  # FSDP's parts ask its one holder
        with pytest.raises(RuntimeError, match="process group was destroyed"):
            part.group


def _mark_at_exit(folder: str) -> int:
    """Rank body: an atexit handler that leaves a file in `folder` when this rank's interpreter shuts down."""
    import atexit

    import torch.distributed as dist

    path = Path(folder) / f"rank{dist.get_rank()}"
    atexit.register(path.write_text, "interpreter shutdown ran")
    return os.getpid()


def test_launch_spawn_ranks_skip_interpreter_shutdown(tmp_path, monkeypatch):
    """`ddp_lib.launch.spawn`'s ranks, forked from multiprocessing's fork server, destroy their group and end with
    the fork server's os._exit, so interpreter shutdown never runs in them: the exit-time abort is a gloo thread ended
    while the process finalizes (tests/test_teardown.py), and no atexit handler runs either. A rank started with
    DDP_START_METHOD=spawn ends through sys.exit and does finalize: only the fork server's ranks are immune this way."""
    from ddp_lib.launch import spawn

    monkeypatch.delenv("DDP_START_METHOD", raising=False)
    pids = spawn(_mark_at_exit, world_size=2, args=(str(tmp_path),), backend="gloo")
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a rank ran interpreter shutdown"


@pytest.mark.timeout(300 * RUNS + 60)
def test_spawned_ranks_exit_cleanly_under_load():
    from exit_abort_cases import cpu_load

    with cpu_load() as pids:  # two busy processes, ended by PID when the runs are over
        assert len(pids) == 2
        lines = _run(str(RUNS), "--group", timeout=300 * RUNS)
    assert lines[-1].startswith(f"{RUNS} runs, 0 failed"), lines


def test_the_sharded_optimizer_holds_its_group_weakly():
    import gc
    import weakref

    import torch
    import torch.distributed as dist

    from ddp_lib.zero import ShardedOptimizer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        opt = ShardedOptimizer([torch.nn.Parameter(torch.ones(3))], torch.optim.SGD, process_group=group, lr=0.1)
        alive = weakref.ref(group)
        del group
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert alive() is None  # the optimizer kept no reference: the group's gloo threads are gone before exit
    with pytest.raises(RuntimeError, match="process group was destroyed"):
        opt.process_group
