"""ddp_lib: the finished code of every lesson of "DDP from scratch"."""

__version__ = "0.1.0"

import os as _os

# the variable that makes a process a simulated GPU box: named here, where nothing imports torch, since the
# simulation must be installed before torch is imported (ddp_lib.gpusim)
GPU_SIM_ENV = "DDP_GPU_SIM"
GPU_SIM_DRY_ENV = "DDP_GPU_SIM_DRY"  # "1" with GPU_SIM_ENV: dry mode, real sizes and no data (ddp_lib.gpusim._dry)


def sim_dry_env() -> bool:
    """Whether this process's environment asks for a dry simulated box (readable before torch is imported)."""
    return bool(_os.environ.get(GPU_SIM_ENV)) and _os.environ.get(GPU_SIM_DRY_ENV) == "1"


if _os.environ.get(GPU_SIM_ENV):  # a simulated GPU box (ddp_lib.gpusim): installed before anything imports torch
    from ddp_lib.gpusim import activate as _activate

    _activate()
