"""The learner's checkers: run on every rank, compare with one process, print one table from rank 0.

    from ddp_lib.check import check_sync
    res = check_sync(sync_gradients)   # rank 0 prints: property, result, failing ranks, largest diff, hint
    res.passed, res.failed             # identical on every rank

How to write a checker of your own: see `ddp_lib.check._runner`'s docstring.
"""

from ddp_lib.check._collective_guard import CollectiveMismatch
from ddp_lib.check._runner import CheckResult, Mismatch, Property, Refusal, Row, collectives, max_diff, run_check
from ddp_lib.check.accumulation import check_accumulation
from ddp_lib.check.basics import check_seed_verification, check_sync
from ddp_lib.check.engine import check_engine
from ddp_lib.check.fsdp import check_fsdp, check_gather_scatter_fn
from ddp_lib.check.fsdp_hooks import check_saved_tensor_hooks
from ddp_lib.check.hsdp_grads import check_hsdp
from ddp_lib.check.mesh_get import check_get
from ddp_lib.check.exposed_comm import check_exposed_comm
from ddp_lib.check.production import check_collective_guard, check_compression_hook, check_shadow_step
from ddp_lib.check.restart import check_resume
from ddp_lib.check.overlap_buckets import check_bucket_engine, check_bucket_plan, check_overlap_hook
from ddp_lib.check.ring import check_ring_allreduce
from ddp_lib.check.allreduce_timing import check_allreduce_timing
from ddp_lib.check.zero1 import check_zero1

__all__ = ["CheckResult", "CollectiveMismatch", "Mismatch", "Property", "Refusal", "Row", "collectives", "max_diff",
           "run_check", "check_sync", "check_seed_verification", "check_accumulation",
           "check_engine", "check_zero1", "check_get", "check_ring_allreduce", "check_overlap_hook",
           "check_bucket_plan", "check_bucket_engine", "check_gather_scatter_fn", "check_saved_tensor_hooks",
           "check_fsdp", "check_allreduce_timing", "check_collective_guard", "check_shadow_step",
           "check_compression_hook", "check_resume", "check_hsdp", "check_exposed_comm", "check_meta_init"]


def __getattr__(name: str):
    """`check_meta_init` on first use: it imports DTensor (about 550 modules) that the other checkers do not need."""
    if name == "check_meta_init":
        from ddp_lib.check.meta_init import check_meta_init
        return check_meta_init
    raise AttributeError(f"module 'ddp_lib.check' has no attribute {name!r}")
