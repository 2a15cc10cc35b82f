"""Loaded by pytest for every path it collects here (`tests/`, and `notebooks/` under nbval, also on its own)."""

from ddp_lib.notebook.kernels import on_ipc

try:
    import nbval.kernel as _nbval_kernel
except ImportError:  # pragma: no cover - nbval is a test requirement
    pass
else:
    # nbval's kernels bind TCP ports its manager chose and let go a moment before: under xdist, beside ranks and
    # other kernels, one was taken meanwhile and a kernel died at start (CI lost a run to it). Unix sockets instead.
    _nbval_kernel.KernelManager = on_ipc(_nbval_kernel.KernelManager)
