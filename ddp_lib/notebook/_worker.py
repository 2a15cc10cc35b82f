"""One rank of `%dist_init`: a torch.distributed process that runs notebook cells sent by the kernel.

Started by the kernel as `sys.executable -m ddp_lib.notebook._worker`, or forked from its template and made the same
(`_fork.forked_main`), with torchrun-style env vars (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) plus
the control-channel port and token.
"""

from __future__ import annotations

import ast
import linecache
import os
import signal
import sys
import traceback
from typing import Any

from ddp_lib.notebook import _protocol as P
from ddp_lib.launch import die_with_parent
from ddp_lib.notebook._worker_io import Channel, Outbox, RankStream

_executing = False
_starting = False  # the cell's "started" message is being sent: a stop now stops the cell before its first line
_stopped = False  # a stop arrived while starting


def _on_sigint(signum, frame):  # noqa: ARG001
    """The kernel's stop button: interrupt the running cell, never the worker's own loop (nor a message half sent)."""
    global _stopped
    if _executing:
        raise KeyboardInterrupt
    if _starting:
        _stopped = True


class Worker:
    """Holds the namespace of one rank and executes cells in it like IPython would."""

    def __init__(self, chan: Channel, outbox: Outbox) -> None:
        self.chan, self.outbox = chan, outbox
        self.rank = int(os.environ.get("RANK", "0"))
        self.ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
        from IPython.core.formatters import DisplayFormatter

        self.formatter = DisplayFormatter()

    def display(self, *objs: Any, raw: bool = False, **kwargs: Any) -> None:
        """`display()` on a rank: the object's rich representations go to the notebook."""
        for obj in objs:
            data, md = (obj, {}) if raw else self.format(obj)
            self.outbox.display(_jsonable(data), _jsonable(md))

    def format(self, obj: Any) -> tuple[dict, dict]:
        """The MIME bundle Jupyter would show for `obj`."""
        if _is_figure(obj):  # without IPython's inline backend the formatter gives text only
            plt = sys.modules.get("matplotlib.pyplot")
            if plt is not None:
                plt.close(obj)  # shown now: the end-of-cell show must not repeat it
            return _figure_png(obj), {}
        return self.formatter.format(obj)

    def run_cell(self, code: str, name: str) -> dict[str, Any]:
        """Execute `code`; the last expression's value is returned as a MIME bundle (None if none)."""
        global _executing, _starting, _stopped
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        result = None
        try:
            tree = ast.parse(code, name, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(code):
                last = ast.Expression(tree.body.pop().value)
            # the kernel interrupts this rank only once "started" arrived: a stop sent earlier could find the rank
            # still before its cell (behind a faster rank, on a loaded machine), be ignored, and the cell run on
            _starting, _stopped = True, False
            self.chan.send({"kind": "started", "rank": self.rank, "cell": self.outbox.cell})
            _executing, _starting = True, False
            if _stopped:
                raise KeyboardInterrupt
            exec(compile(tree, name, "exec"), self.ns)  # noqa: S102 - running the user's cell is the point
            if last is not None:
                value = eval(compile(last, name, "eval"), self.ns)  # noqa: S307
                _executing = False
                if value is not None:
                    self.ns["_"] = value
                    data, md = self.format(value)
                    result = {"data": _jsonable(data), "metadata": _jsonable(md)}
            _executing = False
            _show_figures(self)
            return {"ok": True, "result": result}
        except BaseException as e:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are cell errors too
            _executing = _starting = False
            return {"ok": False, "ename": type(e).__name__, "evalue": str(e), "traceback": _format_tb(e, name)}


def _ends_with_semicolon(code: str) -> bool:
    lines = [ln for ln in code.rstrip().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return bool(lines) and lines[-1].split("#", 1)[0].rstrip().endswith(";")


def _format_tb(e: BaseException, name: str) -> str:
    """The traceback from the user's cell on (the worker's own frames are noise)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != name:
        tb = tb.tb_next
    if isinstance(e, SyntaxError) or tb is None:
        return "".join(traceback.format_exception_only(type(e), e))
    te = traceback.TracebackException(type(e), e, tb)
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
    return "".join(te.format())


def _jsonable(obj: Any) -> Any:
    """MIME bundles hold str/bytes/dicts; bytes (e.g. raw PNG) become base64 text as Jupyter expects."""
    import base64

    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, bytes):
        return base64.b64encode(obj).decode()
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return repr(obj)


def _is_figure(obj: Any) -> bool:
    figure = getattr(sys.modules.get("matplotlib.figure"), "Figure", None)
    return figure is not None and isinstance(obj, figure)


def _figure_png(fig: Any) -> dict[str, Any]:
    """A matplotlib figure as the MIME bundle the inline backend would send."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return {"image/png": buf.getvalue(), "text/plain": repr(fig)}


def _show_figures(worker: Worker) -> None:
    """Like the inline backend: open matplotlib figures are shown (PNG) at the end of the cell, then closed."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        worker.outbox.display(_jsonable(_figure_png(plt.figure(num))), {})
    plt.close("all")


def _setup_namespace(worker: Worker) -> None:
    import torch
    import torch.distributed as dist

    from ddp_lib.mesh import get
    from ddp_lib.devices import init_distributed

    timeout = float(os.environ.get(P.ENV_PG_TIMEOUT, "1800"))
    rank, world_size, device = init_distributed(backend=os.environ.get(P.ENV_BACKEND) or None, timeout_s=timeout)
    gpu = os.environ.get(P.ENV_GPU_ID)
    worker.ns.update(
        torch=torch, dist=dist, rank=rank, world_size=world_size, device=device, get=get,
        gpu_id=int(gpu) if gpu else (device.index if device.type == "cuda" else None),
        display=worker.display,
    )
    try:  # display() imported from IPython also reaches the notebook
        import IPython.core.display_functions as idf
        import IPython.display as idisp

        idf.display = idisp.display = worker.display
    except Exception:  # noqa: BLE001
        pass


def _status(worker: Worker) -> dict[str, Any]:
    import torch

    device = worker.ns["device"]
    info: dict[str, Any] = {"pid": os.getpid(), "device": str(device), "backend": None}
    try:
        info["backend"] = str(worker.ns["dist"].get_backend())
    except Exception:  # noqa: BLE001
        pass
    if device.type == "cuda":
        info["gpu_name"] = torch.cuda.get_device_name(device)
        info["mem_allocated_gb"] = torch.cuda.memory_allocated(device) / 2**30
        info["mem_total_gb"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return info


def _collectives_issued(worker: Worker) -> dict[str, tuple[str, int, list[int]]]:
    """For every process group this rank belongs to (the default group and each subgroup: a mesh dimension's,
    fully_shard's, a `new_group`), which group it is, how many collectives this rank issued on it (its sequence
    number) and its members (global ranks), by group name. Groups whose backend keeps no sequence number are left
    out: the check cannot tell."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or not c10d.is_initialized():
        return {}
    default, issued = c10d._get_default_group(), {}
    for pg, name in list(c10d._world.pg_names.items()):  # a group's name is the same on every rank (c10d)
        try:
            members = sorted(c10d._world.pg_group_ranks[pg])  # the default group's maps every rank too
            which = "the default group" if pg is default else f"the group of ranks {members}"
            issued[name] = (which, int(pg._get_sequence_number_for_group()), members)
        except Exception:  # noqa: BLE001 - a backend without sequence numbers, or a group being torn down
            continue
    return issued


def _issued_since(before: dict[str, tuple[str, int, list[int]]]) -> dict[str, tuple[str, list[int], int]]:
    """The groups this rank issued collectives on since `_collectives_issued` returned `before`: by group name, which
    group, its members (global ranks) and how many collectives."""
    return {name: (which, members, n) for name, (which, seq, members) in _collectives_issued(None).items()
            if (n := seq - (before[name][1] if name in before else 0)) > 0}


def _close(chan: Channel, linger_ms: int) -> None:
    """Let the socket send what it has queued for the kernel (for up to `linger_ms`), then close it. Both uses end the
    process with os._exit (multiprocessing's, in a rank forked from the kernel's template, after a failed start; the
    worker's own at shutdown), which waits for nothing: without ending the context here, a failed start's "hello"
    with its traceback was lost in 1 of 3 runs of test_1b, and the kernel, never told why rank 0 failed, waited for
    the other rank until the start timeout. The flusher thread sends under the channel's lock: taken here too, but not
    waited for longer than the linger (a flusher stuck on a kernel that is gone holds it)."""
    locked = chan.lock.acquire(timeout=linger_ms / 1000)
    try:
        chan.sock.close(linger=linger_ms)
    finally:
        if locked:
            chan.lock.release()
    chan.ctx.term()


def main() -> None:
    """Connect, start the process group, say hello, then serve commands until told to stop."""
    die_with_parent(int(os.environ[P.ENV_PARENT]), os.environ.get(P.ENV_PDEATHSIG) == "1")
    extra = [p for p in os.environ.get(P.ENV_SYSPATH, "").split(os.pathsep) if p]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    signal.signal(signal.SIGINT, _on_sigint)
    chan = Channel(int(os.environ[P.ENV_PORT]), os.environ[P.ENV_TOKEN].encode())
    rank = int(os.environ["RANK"])
    outbox = Outbox(chan)
    worker = Worker(chan, outbox)
    sys.stdout, sys.stderr = RankStream(outbox, "stdout"), RankStream(outbox, "stderr")
    import ddp_lib.notebook._worker_io as wio

    wio.show_figures = lambda: _show_figures(worker)
    try:
        _setup_namespace(worker)
    except BaseException as e:  # noqa: BLE001
        outbox.flush()
        chan.send({"kind": "hello", "rank": rank, "ok": False, "error": "".join(traceback.format_exception(e))})
        _close(chan, 2000)
        return
    outbox.flush()
    chan.send({"kind": "hello", "rank": rank, "ok": True, "status": _status(worker)})
    while True:
        try:
            msg = chan.recv(20)
            if msg is None:
                continue
            op = msg.get("op")
            if op == "exec":
                outbox.cell = msg["cell"]
                before = _collectives_issued(worker)
                reply = worker.run_cell(msg["code"], msg["name"])
                reply["issued"] = _issued_since(before)  # the kernel checks a cell run on some ranks only with it
                for fd in (1, 2):  # tells the kernel it has all fd-level output of this cell
                    os.write(fd, P.fd_mark(msg["cell"]))
            elif op == "sync":
                from ddp_lib import comm  # torch is loaded by now (the rank's process group exists)

                comm.barrier()  # through the collectives layer, as every collective of the package
                reply = {"ok": True}
            elif op == "status":
                reply = {"ok": True, "status": _status(worker)}
            elif op == "shutdown":
                break
            else:
                reply = {"ok": False, "ename": "ValueError", "evalue": f"unknown op {op!r}", "traceback": ""}
            outbox.flush()
            chan.send({"kind": "done", "rank": rank, "cell": msg.get("cell"), "op": op, **reply})
            outbox.cell = None
        except KeyboardInterrupt:  # a stop that arrived between cells: nothing to interrupt
            continue
    outbox.flush()
    try:
        dist = worker.ns["dist"]
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    _close(chan, 500)
    os._exit(0)  # no lingering non-daemon threads a user cell may have started


if __name__ == "__main__":
    main()
