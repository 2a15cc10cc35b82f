"""ddp_lib: the finished code of every lesson of "DDP from scratch"."""

__version__ = "0.1.0"
