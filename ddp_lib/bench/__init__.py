"""Benchmarks of lessons 01, 04, 05: all-reduce (algbw/busbw, α–β fit) and the DDP step race vs torch DDP.

From a notebook on an existing process group (inside %%distributed) call the rank-side functions
`allreduce_rank_bench` / `ddp_rank_bench` on every rank; from plain Python `run_allreduce_bench` /
`run_ddp_bench` spawn local ranks. The CLI is `python -m ddp_lib.bench {allreduce,ddp,sweep}`.
"""

from ddp_lib.bench.allreduce import (allreduce_pipelined_rank_bench, allreduce_rank_bench, bus_factor, format_allreduce,
                                     run_allreduce_bench)
from ddp_lib.bench.alphabeta import AlphaBeta, best_bucket_bytes, exposed_comm_s, fit_alpha_beta, fit_by_group
from ddp_lib.bench.ddp_step import DEFAULT_VARIANTS, ddp_rank_bench, run_ddp_bench
from ddp_lib.bench.race import add_predictions, format_race, overlap_columns
from ddp_lib.bench.workloads import MODELS, get_workload

__all__ = [
    "allreduce_rank_bench", "allreduce_pipelined_rank_bench", "run_allreduce_bench", "format_allreduce", "bus_factor",
    "AlphaBeta", "fit_alpha_beta", "fit_by_group", "exposed_comm_s", "best_bucket_bytes",
    "ddp_rank_bench", "run_ddp_bench", "DEFAULT_VARIANTS",
    "overlap_columns", "format_race", "add_predictions",
    "plot_allreduce", "plot_ddp", "save_rows", "MODELS", "get_workload",
]


def __getattr__(name: str):
    """Import matplotlib only when a plot is asked for (ranks that only measure start faster)."""
    if name in ("plot_allreduce", "plot_ddp", "save_rows"):
        from ddp_lib.bench import plots

        return getattr(plots, name)
    raise AttributeError(f"module 'ddp_lib.bench' has no attribute {name!r}")
