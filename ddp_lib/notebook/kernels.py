"""Kernels this package starts itself (lesson runs, benchmarks, the tests' kernels) talk over Unix sockets.

A TCP kernel's manager picks five free ports, closes them, and the kernel binds them a moment later: meanwhile
another process may take one (ranks' stores, gloo's connections, other kernels starting side by side), and the
kernel dies with "Address already in use" before it answers (CI lost a run to this). An IPC kernel binds socket
files in a private folder instead: nothing to race for, nothing reachable over the network, and ipykernel does
not warn that its channels travel unencrypted. Windows has no IPC transport: TCP there.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import weakref


def _names_transport(kw: dict) -> bool:
    """Whether the caller chose the transport or address itself: by keyword, or in the config it passes."""
    config = kw.get("config") or {}
    return "transport" in kw or "ip" in kw or any(isinstance(section, dict) and "transport" in section
                                                  for section in config.values())


@functools.cache
def on_ipc(manager_class: type) -> type:
    """A subclass of the jupyter_client `manager_class` whose kernels use IPC in their own temp folder.

    The folder is removed with the manager, at exit, or by `remove_sockets()` once the kernel is shut down. A caller
    that names a transport or an address (by keyword or in its config) keeps them."""

    class IPCKernelManager(manager_class):
        def __init__(self, **kw):
            sockets = None
            if os.name == "posix" and not _names_transport(kw):
                sockets = tempfile.mkdtemp(prefix="ddp_kernel_")
                kw.update(transport="ipc", ip=os.path.join(sockets, "k"))  # short: a socket path has ~107 bytes
            super().__init__(**kw)
            self.remove_sockets = (weakref.finalize(self, shutil.rmtree, sockets, True) if sockets
                                   else lambda: None)

    IPCKernelManager.__name__ = IPCKernelManager.__qualname__ = f"IPC{manager_class.__name__}"
    return IPCKernelManager
