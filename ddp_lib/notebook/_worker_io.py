"""A worker's end of the control channel: one DEALER socket, output batching, dying with the kernel."""

from __future__ import annotations

import io
import threading
from typing import Any

import zmq

from ddp_lib.notebook import _protocol as P

show_figures = None  # set by the worker: sends open matplotlib figures to the notebook (plt.show())


class Channel:
    """The socket to the kernel; every access holds `lock` so the flusher thread may send too."""

    def __init__(self, port: int, token: bytes) -> None:
        self.token = token
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_MSG_BYTES)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.lock = threading.Lock()

    def send(self, body: dict[str, Any]) -> None:
        with self.lock:
            self.sock.send_multipart(P.pack(self.token, body))

    def recv(self, timeout_ms: int) -> dict[str, Any] | None:
        """The next command from the kernel (None on timeout or a message without our token)."""
        with self.lock:
            if not self.sock.poll(timeout_ms):
                return None
            frames = self.sock.recv_multipart()
        return P.unpack(self.token, frames)


class Outbox:
    """Collects what the rank writes and sends it in batches: live, but not one message per print."""

    def __init__(self, chan: Channel, interval_s: float = 0.05) -> None:
        self.chan = chan
        self.interval_s = interval_s
        self.items: list[list[Any]] = []  # [kind, payload]; consecutive writes to one stream merge
        self.size = 0
        self.cell: int | None = None
        self.cond = threading.Condition()
        threading.Thread(target=self._loop, name="ddp-nb-flusher", daemon=True).start()

    def write(self, stream: str, text: str) -> None:
        with self.cond:
            if self.items and self.items[-1][0] == stream:
                self.items[-1][1] += text
            else:
                self.items.append([stream, text])
            self.size += len(text)
            if self.size > 1 << 16:
                self.cond.notify()

    def display(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        with self.cond:
            self.items.append(["display", {"data": data, "metadata": metadata}])
            self.cond.notify()

    def flush(self) -> None:
        """Send everything written so far (the socket lock keeps batches in order)."""
        with self.chan.lock:
            with self.cond:
                items, self.items, self.size = self.items, [], 0
            if items:
                self.chan.sock.send_multipart(P.pack(self.chan.token, {"kind": "out", "cell": self.cell, "items": items}))

    def _loop(self) -> None:
        while True:
            with self.cond:
                self.cond.wait(self.interval_s)
                pending = bool(self.items)
            if pending:
                try:
                    self.flush()
                except Exception:  # noqa: BLE001 - the socket closes at exit; nothing left to do
                    return


class RankStream(io.TextIOBase):
    """sys.stdout / sys.stderr of a worker: text goes to the Outbox, tagged with the stream name."""

    def __init__(self, outbox: Outbox, name: str) -> None:
        self.outbox, self.name = outbox, name

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if s:
            self.outbox.write(self.name, s)
        return len(s)

    def flush(self) -> None:
        pass  # the flusher thread sends within `interval_s`; the end of a cell sends the rest
