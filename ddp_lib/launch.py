"""Run a function on N local ranks (free port, finite timeout, every child ended by PID on failure)."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing as mp
import os
import pickle
import queue
import re
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (chosen by the OS, never fixed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), from the parent links in /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@contextmanager
def restored_environ(*names: str) -> Iterator[None]:
    """Whatever the block does to the environment variables `names`, they are as before when it ends."""
    saved = {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def die_with_parent(parent_pid: int, pdeathsig: bool) -> None:
    """Exit as soon as the process that started us is gone (SIGKILL, crash, kernel restart).

    Our OS parent may be `parent_pid` itself (subprocess, `spawn`) or multiprocessing's fork server (which
    exits when `parent_pid` does): PDEATHSIG covers the OS parent, the watchdog polls `parent_pid` itself.
    """
    if pdeathsig and sys.platform.startswith("linux"):
        try:  # the OS parent's death sends us SIGKILL, even if it was SIGKILLed itself
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except Exception:  # noqa: BLE001 - the watchdog below still covers us
            pass
    os_parent = os.getppid()

    def gone() -> bool:
        return os.getppid() != os_parent or not _alive(parent_pid)

    def watch() -> None:
        while True:
            if gone():
                os._exit(0)
            time.sleep(0.5)

    if gone():  # the parent died before we got here
        os._exit(0)
    threading.Thread(target=watch, name="ddp-parent-watchdog", daemon=True).start()


def as_fresh_process(env: dict[str, str], threads: int | None) -> None:
    """In a process forked from a template that imported torch (multiprocessing's fork server): take, where the
    template's state would show, what a fresh interpreter started with `env` would have. `ddp_lib.launch`'s ranks and
    the notebook's forked ranks (`ddp_lib.notebook._fork`) both start with it; a rank that `spawn` starts from scratch
    (`DDP_START_METHOD=spawn`) calls it too, where it changes nothing but the environment and threads.

    `threads`: torch's intra-op thread count; None keeps what the template's OpenMP chose when it loaded torch.
    """
    # What the process inherited (the template's torch and dynamo: about 300,000 tracked objects) stays for good: kept
    # out of the cyclic collector's scans, so a full collection (automatic, or the benchmarks' gc.collect() between
    # variants) walks only what the process creates: 0.02 instead of 0.7 CPU s each. Reference counting still frees
    # these objects; only a cycle among them would now outlive the process's own collections.
    gc.freeze()
    os.environ.clear()  # the template's environment was its starter's when it started: ours is `env`
    os.environ.update(env)
    if threads:  # OpenMP read its variables when the template imported torch
        import torch

        torch.set_num_threads(threads)
    # A fork inherits its parent's generator states: numpy seeded its global generator once, when the template imported
    # it (importing torch does), so every process forked from it would draw the same numbers. Python's `random` reseeds
    # its global generator itself in a forked child (os.register_at_fork in Lib/random.py).
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()


def _worker(fn, args, kwargs, rank, world_size, port, backend, threads, pg_timeout_s, results, parent, env) -> None:
    die_with_parent(*parent)  # a parent killed by SIGKILL would otherwise leave ranks stuck in collectives
    # the caller's environment as it is now (a fork server was started with an older one); 2 ranks on 2 cores: one
    # thread each, no oversubscription
    as_fresh_process(env | {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                     threads)
    import torch.distributed as dist

    from ddp_lib.devices import init_distributed

    try:
        try:
            init_distributed(backend=backend, timeout_s=pg_timeout_s)
        except BaseException:  # noqa: BLE001 - `fn` has not run: spawn may start the ranks again (see RENDEZVOUS)
            results.put((rank, "init-error", traceback.format_exc()))
            return
        out = fn(*args, **kwargs)
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent, with its traceback
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            _outlive_peers(rank, world_size, pg_timeout_s)
            dist.destroy_process_group()


def _outlive_peers(rank: int, world_size: int, timeout_s: float) -> None:
    """Every rank stays until every rank is done, and rank 0, which hosts the TCP store, leaves last.

    A rank that left as soon as its own `fn` returned closed its gloo connections while a slower peer was still
    connecting them: that peer's init failed ("Gloo connectFullMesh failed ... Connection closed by peer") and the
    one after it waited for the dead peer until the timeout (2 ranks of 4, in a CI run on a loaded 2-core machine,
    for a `fn` that does nothing). And a peer still reading the store, e.g. a checker's last exchange, would get
    "Connection reset by peer" if rank 0 left first.
    """
    import torch.distributed.distributed_c10d as c10d

    def wait_for(key: str, count: int) -> None:
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < count and time.monotonic() < deadline:
            time.sleep(0.01)

    try:
        store = c10d._get_default_store()
        store.add("ddp_lib/launch/done", 1)
        wait_for("ddp_lib/launch/done", world_size)  # every rank finished `fn` (so its init, too)
        if rank == 0:
            wait_for("ddp_lib/launch/left", world_size - 1)  # nobody reads the store any more
        else:
            store.add("ddp_lib/launch/left", 1)
    except Exception:  # noqa: BLE001 - a peer that died: the parent reports it, nothing to wait for
        pass


def _context():
    """multiprocessing's fork server, preloaded with torch, where the platform has one; else `spawn`.

    The fork server is a fresh interpreter (never a fork of the caller: no CUDA state, no threads) that
    imports torch once and forks every rank from there.
    """
    method = os.environ.get("DDP_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        # torch._dynamo too: a rank's first optimizer (and every check's warm-up) imports it, about 2 s of CPU
        # per rank on 2 cores; imported once here, every forked rank finds it loaded
        ctx.set_forkserver_preload(["ddp_lib", "torch", "torch.distributed", "torch._dynamo", "ddp_lib.mesh",
                                    "ddp_lib.launch"])
    return ctx


class RankError(RuntimeError):
    """One or more ranks failed; the message holds each failing rank's traceback, in rank order."""


# What a rendezvous on a free port can meet that has nothing to do with `fn`: the port taken between free_port()
# and rank 0's bind (free_port closes its socket before the store opens it), or a store connection dropped while the
# ranks meet. spawn starts the ranks again, once, on another port, when a rank failed with one of these before `fn`
# ran and no rank got further; any other error is reported at once.
RENDEZVOUS = ("address already in use", "connection closed by peer", "connection reset by peer",
               "connection refused")


def rendezvous_failure(traceback_text: str) -> str | None:
    """The last line of a rank's traceback when it failed for one of the RENDEZVOUS reasons, else None."""
    if any(m in traceback_text.lower() for m in RENDEZVOUS):
        return traceback_text.strip().splitlines()[-1]
    return None


_STOPPED = re.compile(r"rank \d+ did not finish within ")  # a rank the parent stopped waiting for


def _rendezvous_error(init_errors: dict[int, str], outputs: dict, errors: dict[int, str]) -> str | None:
    """The traceback of a rank whose init failed with a network error above, when the run failed only at the
    rendezvous: no rank returned or raised from `fn`, and every other failure is a rank the parent stopped waiting
    for. Else None."""
    if outputs or any(r not in init_errors and not _STOPPED.match(msg) for r, msg in errors.items()):
        return None  # a rank returned, raised from fn, or died on its own
    return next((tb for tb in init_errors.values() if rendezvous_failure(tb)), None)


def spawn(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    kwargs: dict | None = None,
    backend: str | None = "gloo",
    timeout_s: float = 120.0,
    threads: int | None = None,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` fresh processes with an initialised process group.

    `backend` defaults to gloo, whatever GPUs the machine has: `fn` computes on the CPU unless it asks for
    "nccl" (one GPU per rank), or for "auto" and picks its device with `ddp_lib.mesh.comm_device()`.
    None means gloo too: a caller that wants the machine to choose says "auto".
    Returns the per-rank return values in rank order. When any rank raises, or the whole run
    exceeds `timeout_s`, the other ranks are terminated (by PID) and RankError is raised.
    `fn` must be importable (defined at module level). Ranks start from a fork server that has imported
    torch once (about 30 ms a rank instead of 1.5 s on 2 cores), with the caller's current environment and a numpy
    seed of its own (`as_fresh_process`); each rank computes on `threads` threads (default: the cores over the ranks);
    `DDP_START_METHOD=spawn` (or a platform without fork servers) starts each from scratch instead.
    Ranks that cannot meet for a reason of the network before `fn` runs (the port taken meanwhile, a dropped store
    connection: RENDEZVOUS) are started again once, on another port, saying so on stderr.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    backend = backend or "gloo"  # a CPU test on a GPU box must not get nccl by accident
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    for attempt in (1, 2):
        port = free_port()
        outputs, errors, init_errors = _run_ranks(fn, world_size, args, kwargs or {}, backend, timeout_s, threads, port)
        if attempt == 1 and (failed := _rendezvous_error(init_errors, outputs, errors)):
            print(f"ddp_lib.launch: the ranks could not meet on port {port} ({failed.strip().splitlines()[-1]}); "
                  f"starting them again on another port", file=sys.stderr, flush=True)
            continue
        break
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise RankError(f"{len(errors)} of {world_size} ranks failed:\n{report}")
    return [outputs[r] for r in range(world_size)]


def _run_ranks(fn, world_size, args, kwargs, backend, timeout_s, threads, port):
    """Start the ranks once, on `port`; return ({rank: output}, {rank: error}, {rank: init error}), every process
    ended by then. The init errors are in the errors too."""
    ctx = _context()
    results = ctx.Queue()
    pg_timeout_s = max(5.0, timeout_s)
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, args, kwargs, r, world_size, port, backend, threads, pg_timeout_s, results,
                  (os.getpid(), threading.current_thread() is threading.main_thread()), dict(os.environ)),
            daemon=True,  # a parent that dies takes its ranks with it
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    init_errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - outputs.keys() - errors.keys())
                errors.update({r: f"rank {r} did not finish within {timeout_s:.0f} s" for r in missing})
                break
            try:
                rank, status, payload = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in outputs and r not in errors]
                for r in dead:
                    errors[r] = f"rank {r} died with exit code {procs[r].exitcode}"
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                if status == "init-error":
                    init_errors[rank] = payload
                # peers blocked in a collective with the failed rank would only time out: give them
                # a moment to report their own error, then stop waiting
                deadline = min(deadline, time.monotonic() + 2.0)
    finally:
        for p in procs:
            p.join(timeout=0.2 if errors else 5.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return outputs, errors, init_errors


def run_on_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), kwargs: dict | None = None,
                 backend: str | None = "auto", timeout_s: float = 600.0, threads: int | None = None) -> Any:
    """`fn(*args, **kwargs)` where the ranks are: here, when this process is one already (torchrun set
    RANK, or a notebook cell runs inside a process group), else on `world_size` spawned local ranks.

    For scripts that pick their device from the group (`comm_device()`/`rank_device()`): `backend` None or
    "auto" lets the machine choose (nccl with a GPU per rank, else gloo); give "gloo" to stay on the CPU.
    Returns this rank's result, or rank 0's when spawned. A process group this call initialises from
    env:// stays up for the caller (who may still need it, and destroys it).
    """
    import torch.distributed as dist  # here: the kernel imports this module for free_port alone

    if dist.is_initialized() or "RANK" in os.environ:
        from ddp_lib.devices import init_distributed

        init_distributed(backend=backend, timeout_s=timeout_s)
        return fn(*args, **(kwargs or {}))
    return spawn(fn, world_size, args, kwargs, backend or "auto", timeout_s, threads)[0]
