"""A checker (or a lesson's helper) called where no process group exists (a cell run in a restarted kernel, whose ranks
are gone) says what to run, naming itself, instead of torch's "Default process group has not been initialized"."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import ddp_lib.check as C

# check_hsdp spawns its own 4 ranks, so it runs without a process group
NEED_RANKS = sorted(n for n in C.__all__ if n.startswith("check_") and n != "check_hsdp")


def _learner(*args, **kwargs):
    raise AssertionError("a checker without a process group must refuse before it calls the learner's code")


@pytest.mark.parametrize("name", NEED_RANKS)
def test_checker_without_process_group_names_what_to_run(name):
    assert not dist.is_initialized()  # the test process itself never joins a group (the suite spawns ranks)
    check = getattr(C, name)
    args = (_learner, _learner) if name == "check_resume" else (_learner,)
    with pytest.raises(RuntimeError) as err:
        check(*args)
    msg = str(err.value)
    assert f"{name}() needs a process group" in msg
    assert "%dist_init" in msg and "restart" in msg


@pytest.mark.parametrize("module, name, call", [
    # lesson 08's fsdp-tied-code
    ("ddp_lib.torch_fsdp.tied", "tied_side_by_side", lambda helper: helper("tiny", steps=1)),
    ("ddp_lib.apps.flight", "dump_flight_record", lambda helper: helper("unused")),  # lesson 09's c07a
])
def test_lesson_helper_without_process_group_names_what_to_run(module, name, call):
    """Helpers that a lesson cell calls before it reads anything else an earlier cell defined: in a restarted kernel
    they reached torch's error first."""
    import importlib

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=name + r"\(\) needs a process group.*%dist_init"):
        call(getattr(importlib.import_module(module), name))
