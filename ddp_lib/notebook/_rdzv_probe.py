"""Whether a c10d rendezvous endpoint can work, checked before torchrun waits on it.

torchrun's c10d backend first tries to host its TCPStore on the endpoint; when the port is taken it connects to it as
a client, and the client's handshake (TCPStore's constructor: validate, then a ping) reads the store's answer with no
time limit. A program there that is not a store never answers, so torchrun waits forever: `--rdzv-conf`'s
`read_timeout`, `join_timeout` and `timeout` all come later and bound none of it. This probe makes the same handshake
with a limit. The launch file (`ddp_lib.notebook._launch_files`) copies the source between the markers, so it needs
torch alone; the copy here is what the tests import.
"""

# --- probe: begin ---
from __future__ import annotations

import socket
import sys
import threading
from datetime import timedelta


def endpoint_problem(host: str, port: int, wait_s: float = 15.0) -> str | None:
    """None if nothing listens on host:port (a node will host the store there) or a c10d store answers; else why not."""
    try:
        socket.create_connection((host, port), timeout=wait_s).close()
    except OSError:
        return None  # refused, unreachable or unknown: torchrun itself says so, within its own timeouts
    import torch.distributed as dist

    answer: dict = {}

    def handshake() -> None:
        try:
            # half the wait: a peer that hangs up makes the client retry until its timeout, which must end first
            dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=wait_s / 2))
            answer["store"] = True
        except Exception as e:  # noqa: BLE001 - any failure of the handshake means: not a store
            answer["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    thread = threading.Thread(target=handshake, daemon=True)  # a silent peer blocks it for good: left behind
    thread.start()
    thread.join(wait_s)
    if answer.get("store"):
        return None
    why = (f"it failed a c10d store's handshake ({answer['error']}); torchrun would fail there too" if "error" in answer
           else f"it accepted a connection but did not answer a c10d store's ping within {wait_s:g} s; torchrun would "
           "wait there forever")
    return (f"rendezvous endpoint {host}:{port} is held by another program, not a c10d store: {why}. Pick a free port "
            "on that host (RDZV_PORT=...)")


if __name__ == "__main__":
    import os

    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")  # the client's retry warnings: the verdict below says it
    problem = endpoint_problem(sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:4]))
    if problem:
        print(f"RendezvousEndpointError: {problem}", file=sys.stderr)
        sys.exit(3)
# --- probe: end ---
