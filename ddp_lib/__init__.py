"""ddp_lib: the finished code of every lesson of "DDP from scratch"."""

__version__ = "0.1.0"

import os as _os

if _os.environ.get("DDP_GPU_SIM"):  # a simulated GPU box (ddp_lib.gpusim): installed before anything imports torch
    from ddp_lib.gpusim import activate as _activate

    _activate()
