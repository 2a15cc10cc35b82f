"""Wire format between the kernel and its workers: JSON only, every message carries the session token.

Frames (worker -> kernel, seen by the kernel's ROUTER): [identity, token, json body].
Frames (kernel -> worker, seen by the worker's DEALER):  [token, json body].
The receiver compares the token frame (constant time) before it even parses the body, and no
frame is ever unpickled: a peer that is not one of this session's workers can neither run code
nor inject output.
"""

from __future__ import annotations

import hmac
import json
import re
import secrets
from typing import Any

ENV_PORT = "DDP_NB_PORT"
ENV_TOKEN = "DDP_NB_TOKEN"
ENV_PARENT = "DDP_NB_PARENT_PID"
ENV_PDEATHSIG = "DDP_NB_PDEATHSIG"
ENV_SYSPATH = "DDP_NB_SYSPATH"
ENV_GPU_ID = "DDP_NB_GPU_ID"
ENV_PG_TIMEOUT = "DDP_NB_PG_TIMEOUT"
ENV_BACKEND = "DDP_NB_BACKEND"

FD_MARK = re.compile("\x00ddpnb-end-(\\d+)\x00")  # written to fd 1 and 2 after each cell


def fd_mark(cell: int) -> bytes:
    return f"\x00ddpnb-end-{cell}\x00".encode()


MAX_MSG_BYTES = 256 * 1024 * 1024  # an unknown peer cannot make the kernel buffer more than this


def new_token() -> bytes:
    """A fresh per-session secret (hex, so it travels in an environment variable)."""
    return secrets.token_hex(32).encode()


def pack(token: bytes, body: dict[str, Any]) -> list[bytes]:
    """Frames for one message."""
    return [token, json.dumps(body, separators=(",", ":")).encode()]


def unpack(token: bytes, frames: list[bytes]) -> dict[str, Any] | None:
    """The message body, or None when the token is wrong or the frames are malformed."""
    if len(frames) != 2 or not hmac.compare_digest(frames[0], token):
        return None
    try:
        body = json.loads(frames[1])
    except ValueError:
        return None
    return body if isinstance(body, dict) else None
