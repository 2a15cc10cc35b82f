"""matplotlib backend of the ranks: Agg rendering, and `plt.show()` sends the figures to the notebook."""

from __future__ import annotations

from matplotlib.backend_bases import FigureManagerBase, _Backend
from matplotlib.backends.backend_agg import FigureCanvasAgg

from ddp_lib.notebook import _worker_io


@_Backend.export
class _BackendRank(_Backend):
    FigureCanvas = FigureCanvasAgg
    FigureManager = FigureManagerBase

    @staticmethod
    def show(*args, **kwargs):  # noqa: ARG004
        """Show every open figure in the cell's output (like the inline backend), then close them."""
        if _worker_io.show_figures is not None:
            _worker_io.show_figures()
