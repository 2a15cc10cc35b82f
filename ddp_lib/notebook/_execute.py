"""Run one cell on some ranks and wait for every answer: no polling delay, no fixed limit, no hang."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

from ddp_lib.notebook._cluster import Cluster
from ddp_lib.notebook._render import CellInterrupted, Collector, MimeBundle, RankError, live_after_s

ENV_TIMEOUT = "DDP_NB_TIMEOUT"  # default per-cell limit in seconds (unset or 0: no limit)
ENV_GRACE = "DDP_NB_GRACE"  # how long interrupted ranks get to stop before they are killed


def default_timeout() -> float | None:
    v = float(os.environ.get(ENV_TIMEOUT, "0") or 0)
    return v if v > 0 else None


def grace_s() -> float:
    return float(os.environ.get(ENV_GRACE, "5"))


class BrokenCluster(RuntimeError):
    """The ranks can no longer run cells together; `%dist_init` starts fresh ones."""

    def _render_traceback_(self) -> list[str]:
        return [f"BrokenCluster: {self}"]


FD_MARK_WAIT_S = 30.0  # how long raw fd output of finished ranks may lag (1 MB on a loaded machine: seconds)


def cell_name(cluster: Cluster, seq: int, label: int | None) -> str:
    """The file name tracebacks give the cell: `<cell [3]>` for the cell the notebook shows as `[3]`.

    A label seen before (a silent execution does not advance the count) gets the internal sequence
    number too, so that the source lines of functions defined in the earlier cell stay in linecache.
    """
    if label is None:
        return f"<cell #{seq}>"
    name = f"<cell [{label}]>"
    if name in cluster.cell_names:
        name = f"<cell [{label}] #{seq}>"
    cluster.cell_names.add(name)
    return name


def run_cell(cluster: Cluster, ranks: list[int], code: str, timeout_s: float | None,
             label: int | None = None) -> MimeBundle | None:
    """Execute `code` on `ranks`; show their output; raise RankError if any rank failed.

    `label` is the kernel's execution count, the number the notebook shows beside the cell.
    """
    dead = [r for r in range(cluster.n) if not cluster.alive(r)]  # e.g. ended by a watchdog between cells
    if dead and not cluster.broken:
        cluster.broken = ", ".join(f"rank {r} died (exit code {cluster.procs[r].returncode})" for r in dead)
    if cluster.broken:
        raise BrokenCluster(f"the workers are not usable ({cluster.broken}); run %dist_init to start new ones")
    cluster.cell_seq += 1
    cell = cluster.cell_seq
    name = cell_name(cluster, cell, label)
    col = Collector(ranks)
    fd_wait = {(r, s) for r in ranks for s in ("stdout", "stderr")}  # end marks still to come
    fd_by: float | None = None

    def take_fd() -> None:
        for r in ranks:  # raw fd output (C extensions, subprocesses) drained by the cluster's threads
            for stream, text in _take(cluster, r):
                if stream == "mark":
                    if text[1] == cell:
                        fd_wait.discard((r, text[0]))
                else:
                    col.add(r, stream, text, raw=True)

    take_fd()
    # a press from the first send on is counted, never raised: one landing between two sends left some ranks running
    # the cell unwatched and others without it (no rank has started yet: each is stopped as it starts)
    with _counting_stop_presses() as presses:
        for r in ranks:
            cluster.send(r, {"op": "exec", "cell": cell, "code": code, "name": name})
        pending = set(ranks)
        start = time.monotonic()
        live_after = live_after_s()
        deadline = start + timeout_s if timeout_s else None
        stop_by: float | None = None  # when interrupted/aborted ranks must have answered
        interrupt_at: float | None = None  # when ranks still running after another rank failed are interrupted
        interrupted = False
        handled = 0  # stop presses acted on
        started: set[int] = set()  # ranks whose "started" arrived: only these can be interrupted in this cell
        owed: set[int] = set()  # ranks to interrupt as soon as they start (a stop sent before would be lost)
        hurried = False  # pressed twice: no rank gets any more time
        issued: dict[int, dict] = {}  # per rank that answered: the groups it issued collectives on in this cell

        def interrupt(to_stop) -> None:
            cluster.interrupt([r for r in to_stop if r in started])
            owed.update(r for r in to_stop if r not in started)

        while pending or (fd_wait and time.monotonic() < fd_by):
            if presses[0] > handled:  # the notebook's stop button: stop the ranks, keep them usable
                again, handled = handled > 0, presses[0]
                if not pending:  # every rank has answered; only their raw output's end marks are awaited
                    fd_by = time.monotonic()  # stop waiting for it: the cell ran to its end, it was not interrupted
                    continue
                interrupted = True
                if again and stop_by is not None:  # pressed again: do not wait any longer
                    stop_by, hurried = time.monotonic(), True
                elif stop_by is None:  # (a timeout or a failed peer may have interrupted the ranks already)
                    interrupt(pending)
                    stop_by = time.monotonic() + grace_s()
            msgs = cluster.recv(50 if pending else 5)
            for ident, msg in msgs:
                r = cluster.rank_of.get(ident)
                if r is None:
                    continue
                if msg.get("cell") != cell:
                    if msg.get("kind") == "out" and r in col.items:  # late output of an earlier cell
                        _add_items(col, r, msg["items"])
                    continue
                if msg["kind"] == "out":
                    _add_items(col, r, msg["items"])
                elif msg["kind"] == "started":
                    started.add(r)
                    if r in owed and r in pending:
                        owed.discard(r)
                        cluster.interrupt([r])
                        if stop_by is not None and not hurried:  # its grace runs from its own interrupt
                            stop_by = max(stop_by, time.monotonic() + grace_s())
                elif msg["kind"] == "done" and r in pending:
                    pending.discard(r)
                    issued[r] = msg.get("issued") or {}
                    if msg.get("ok"):
                        col.results[r] = msg.get("result")
                    else:
                        col.errors[r] = msg.get("traceback") or f"{msg.get('ename')}: {msg.get('evalue')}\n"
                        col.summaries.setdefault(r, f"{msg.get('ename')}: {msg.get('evalue')}")
            take_fd()
            now = time.monotonic()
            for r in list(pending):
                if not cluster.alive(r):
                    pending.discard(r)
                    code_ = cluster.procs[r].returncode
                    col.errors[r] = f"rank {r} died (exit code {code_})\n"
                    col.summaries[r] = f"died (exit code {code_})"
                    cluster.broken = f"rank {r} died"
            if pending and stop_by is None and col.errors and interrupt_at is None:
                interrupt_at = now + grace_s()  # the others may still finish (or fail) on their own
            timed_out = deadline is not None and now > deadline
            if pending and stop_by is None and (timed_out or (interrupt_at is not None and now > interrupt_at)):
                if timed_out:
                    for r in sorted(pending):
                        col.summaries[r] = f"did not answer within {timeout_s:g} s (timeout)"
                # a failed rank leaves its peers waiting in a collective: interrupt them, then kill
                interrupt(pending)
                stop_by = now + grace_s()
            if pending and stop_by is not None and now > stop_by:
                for r in sorted(pending):
                    col.errors[r] = (
                        f"rank {r} did not stop within {grace_s():g} s of being interrupted (probably blocked in "
                        "a collective that a failed rank never joined); it was killed\n"
                    )
                    col.summaries.setdefault(r, "did not stop when interrupted; killed")
                cluster.kill(pending)
                cluster.broken = f"rank(s) {sorted(pending)} had to be killed"
                pending.clear()
            if not pending:
                if fd_by is None:  # a live rank always writes its end marks: only a hung pipe reader misses it
                    fd_by = now + FD_MARK_WAIT_S
                fd_wait.difference_update({(r, s) for r, s in fd_wait if not cluster.alive(r)})  # killed: no marks
            if not col.live and now - start > live_after:
                col.start_live()
        # still counted, not raised: a press now finds the ranks answered (or killed), and the check must not be cut
        if (col.summaries or interrupted) and not cluster.broken:
            cluster.broken = desynchronised(issued, ranks)
        broke_quietly = False  # every rank of the cell ended "ok", yet the workers cannot go on
        if not (col.summaries or interrupted or cluster.broken):
            cluster.broken = left_pending(issued, ranks)
            broke_quietly = cluster.broken is not None
    ret = col.render()
    if cluster.broken:
        import sys

        print(f"The workers are not usable any more ({cluster.broken}): run %dist_init to restart them.",
              file=sys.stderr)
    if interrupted:
        raise CellInterrupted
    if col.summaries:
        raise RankError(col.summaries)
    if broke_quietly:
        raise BrokenCluster(f"the workers are not usable ({cluster.broken}); run %dist_init to start new ones")
    return ret


def left_pending(issued: dict[int, dict], ranks: list[int]) -> str | None:
    """After a cell that ended "ok" on `ranks`: a collective one of them issued on a group with a rank that did not run
    the cell (a `%%rank [0]` all-reduce) was never joined. NCCL (and `async_op=True`) returned as soon as it was
    queued, and the peers' next collective on that group would pair with it: a wrong result, or a hang. None: none."""
    for r in sorted(issued):
        for which, members, n in issued[r].values():
            outside = sorted(set(members) - set(ranks))
            if outside:
                return (f"rank {r} issued {n} collective(s) on {which} in a cell that rank(s) {outside} did not run, "
                        "so it is still pending (NCCL, or async_op=True, returns before the peers join) and the "
                        "peers' next collective would pair with it")
    return None


@contextmanager
def _counting_stop_presses():
    """While the cell runs, a stop press (SIGINT) is counted, not raised: the loop acts on it at its next turn.

    Raised, the KeyboardInterrupt lands wherever the loop is: while it shows a rank's output it escaped as a bare
    KeyboardInterrupt, the ranks were never told to stop and a message in hand (a rank's 'done') was lost. The
    count is read within one `recv` wait (50 ms). Off the main thread no signal reaches this code: nothing to count.
    """
    presses = [0]

    def count(signum, frame) -> None:
        presses[0] += 1

    try:
        before = signal.signal(signal.SIGINT, count)
    except ValueError:  # not the main thread
        before = None
    try:
        yield presses
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)


def desynchronised(issued: dict[int, dict], ranks: list[int]) -> str | None:
    """After a cell that failed (or was stopped) on some rank: did the members of every group issue as many collectives
    in this cell?

    On gloo a rank whose peer never joined its collective is stuck and gets killed. On NCCL a collective returns as
    soon as it is queued, so a healthy rank can finish the cell "ok" with a collective still pending; the failed
    rank's next collective would then pair with it (wrong sums, or a hang). The same happens on gloo with
    `async_op=True`. Each rank reports, with its answer, the groups it issued collectives on during the cell and how
    many (`issued`: the default group and every subgroup, a mesh's or fully_shard's, where a desync leaves the
    default group's counts equal); a member that did not run the cell issued none. Counts of this cell, not totals:
    a group abandoned on purpose in an earlier cell (lesson 09 times one out) stays uneven for good, and must not
    fail every later cell that fails. None: they agree. (A rank that ran the cell and never answered was killed,
    and the cluster is marked broken for that already.)
    """
    groups: dict[str, tuple[str, list[int]]] = {}  # group name -> (which group, its members)
    for reported in issued.values():
        for name, (which, members, _) in reported.items():
            groups[name] = (which, list(members))
    for name, (which, members) in groups.items():
        counts = {m: issued.get(m, {}).get(name, (which, members, 0))[2]  # a member that did not run the cell: 0
                  for m in members if m in issued or m not in ranks}
        if len(set(counts.values())) <= 1:
            continue
        shown = ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items()))
        return (f"after the failure the ranks have issued different numbers of collectives in this cell ({shown}) "
                f"on {which}, so one is still pending on some rank (NCCL, or async_op=True, returns before the peers "
                "join) and the next collective would pair with it")
    return None


def _take(cluster: Cluster, rank: int):
    q = cluster.stray.get(rank)
    while q:
        yield q.popleft()


def _add_items(col: Collector, rank: int, items) -> None:
    for kind, payload in items:
        col.add(rank, kind, payload)
