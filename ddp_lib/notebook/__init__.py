"""`%load_ext ddp_lib.notebook`: nbdistributed 0.1.0's magics (same names and arguments), hardened.

Ranks are started with the kernel's own interpreter, join one process group (gloo on CPU, nccl with
`-g`), and talk to the kernel over a loopback socket that only they can use (per-session token,
JSON only: nothing is ever unpickled). Cells run like IPython runs them, output streams live and is
then shown per rank in rank order, any failing rank fails the cell, and the ranks end with
`%dist_shutdown`, with the kernel, or when the kernel dies.
"""

from __future__ import annotations

_magics = None


def load_ipython_extension(ipython) -> None:
    """Register the magics with this IPython shell."""
    global _magics
    from ddp_lib.notebook.magics import DistributedMagics

    _magics = DistributedMagics(ipython)
    ipython.register_magics(_magics)


def unload_ipython_extension(ipython) -> None:
    """End the ranks when the extension is unloaded."""
    global _magics
    if _magics is not None:
        ipython.events.unregister("pre_run_cell", _magics._note_cell)
        _magics._stop(1.0)
        _magics = None


def cluster():
    """The running Cluster of this kernel (None before %dist_init): PIDs, port, for tests and tools."""
    return _magics.cluster if _magics is not None else None
