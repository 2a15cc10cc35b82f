"""Point `torch.cuda`, `torch.accelerator` and torch.distributed's group creation at the simulation."""

from __future__ import annotations

import contextlib
import functools

import torch

from ddp_lib.gpusim import _box, _cuda, _rng


def _not_simulated(what: str) -> type:
    # a class, as torch's are (annotations such as `torch.cuda.CUDAGraph | None` must still evaluate)
    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"not simulated: {what} (ddp_lib.gpusim)")
    return type(what.replace(" ", ""), (), {"__init__": refuse})


class _Device:
    """torch.cuda.device: make `device` current for the block."""

    def __init__(self, device) -> None:
        self.device, self.previous = device, None

    def __enter__(self):
        self.previous = _cuda.current_device()
        if self.device is not None and not (isinstance(self.device, int) and self.device < 0):
            _cuda.set_device(self.device)
        return self

    def __exit__(self, *exc) -> None:
        _cuda.set_device(self.previous)


def _own(fn):
    """A distinct function object calling `fn`."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **kwargs)
    return call


def _rng_index(device) -> int:
    # torch.cuda.get_rng_state's device: an index, "cuda", "cuda:i" or a torch.device (None index: the current one)
    if isinstance(device, int):
        return _cuda.check_index(device)
    return _cuda.check_index(torch.device(device).index)


def patch_torch_cuda() -> None:
    """Replace the torch.cuda queries the course and torch's own Python code make."""
    c, p = torch.cuda, _cuda
    n = _box.profile.count
    props = p.get_device_properties
    simple = {
        "is_available": lambda: True, "device_count": lambda: n, "_lazy_init": lambda: None,
        "current_device": p.current_device, "set_device": p.set_device, "synchronize": p.synchronize,
        "Event": p.Event, "Stream": p.Stream, "current_stream": p.current_stream,
        "default_stream": _own(p.current_stream),
        "stream": p.stream, "set_stream": lambda s: None, "device": _Device,
        "get_device_properties": props, "get_device_name": lambda d=None: props(d).name,
        "get_device_capability": lambda d=None: (props(d).major, props(d).minor),
        "memory_allocated": p.memory_allocated, "max_memory_allocated": p.max_memory_allocated,
        "memory_reserved": p.memory_allocated, "max_memory_reserved": p.max_memory_allocated,
        "reset_peak_memory_stats": p.reset_peak_memory_stats, "reset_max_memory_allocated": p.reset_peak_memory_stats,
        "mem_get_info": p.mem_get_info, "memory_stats": p.memory_stats, "empty_cache": lambda: None,
        "is_current_stream_capturing": lambda: False, "ipc_collect": lambda: None,
        # one (seed, offset) per GPU, as CUDA's Philox generators (ddp_lib.gpusim._rng)
        "get_rng_state": lambda device="cuda": _rng.get_state(_rng_index(device)),
        "get_rng_state_all": lambda: [_rng.get_state(i) for i in range(n)],
        "set_rng_state": lambda state, device="cuda": _rng.set_state(state, _rng_index(device)),
        "set_rng_state_all": lambda states: [_rng.set_state(s, i) for i, s in enumerate(states)] and None,
        "manual_seed": lambda seed: _rng.manual_seed(seed, p.current_device()),
        "manual_seed_all": lambda seed: [_rng.manual_seed(seed, i) for i in range(n)] and None,
        "initial_seed": lambda: _rng._pair(p.current_device())[0],
        "_sleep": p.sleep,
        "CUDAGraph": _not_simulated("CUDA graphs"), "graph": _not_simulated("CUDA graphs"),
    }
    for name, fn in simple.items():
        setattr(c, name, fn)
    c.memory.memory_allocated = p.memory_allocated
    c.memory.max_memory_allocated = p.max_memory_allocated
    c.memory.reset_peak_memory_stats = p.reset_peak_memory_stats
    c.memory.mem_get_info = p.mem_get_info
    # NVTX ranges are no-ops without a profiler attached, as on a box
    c.nvtx.range_push = lambda msg: 0
    c.nvtx.range_pop = lambda: 0
    c.nvtx.range = contextlib.nullcontext
    acc = torch.accelerator
    acc.is_available = lambda: True
    acc.device_count = lambda: n
    acc.current_accelerator = lambda check_available=False: torch.device("cuda")
    # each its own function object, never torch.cuda's: dynamo keeps one handler per function and asserts "Handler
    # already registered" when torch.accelerator.current_stream is torch.cuda.current_stream (torch/_dynamo/
    # variables/torch.py, _get_handlers), which broke every torch.compile on simulated CUDA
    for name, fn in (("current_device_index", p.current_device), ("set_device_index", p.set_device),
                     ("current_stream", p.current_stream), ("synchronize", p.synchronize),
                     ("memory_allocated", p.memory_allocated), ("max_memory_allocated", p.max_memory_allocated),
                     ("reset_peak_memory_stats", p.reset_peak_memory_stats)):
        if name in ("current_device_index", "set_device_index", "current_stream", "synchronize") or hasattr(acc, name):
            setattr(acc, name, _own(fn))
    _patch_group_creation()
    torch.compile = _eager_compile


def _eager_compile(model=None, **kwargs):
    """torch.compile under the simulation: the model unchanged (eager), with a warning saying so."""
    import warnings

    if model is None:  # @torch.compile(...) as a decorator
        return lambda fn: _eager_compile(fn, **kwargs)
    # dynamo's fake-tensor conversion of the wrapper subclass fails ("Attempted to set the storage of a tensor on
    # device cuda:0 to a storage on different device meta"): nothing compiled is simulated
    warnings.warn("ddp_lib.gpusim: torch.compile is not simulated; the model runs eagerly (no graph, no backend "
                  "call)", stacklevel=2)
    return model


def _patch_group_creation() -> None:
    # "cpu:gloo,cuda:nccl": the simulated NCCL group serves CPU tensors too (over its gloo), as the real pair does
    import torch.distributed.distributed_c10d as c10d

    from ddp_lib.gpusim import _nccl2
    from ddp_lib.gpusim._nccl import SimNCCL

    original = c10d._new_process_group_helper
    if getattr(original, "_ddp_gpusim", False):
        return

    @functools.wraps(original)
    def helper(group_size, group_rank, global_ranks, backend, *args, **kwargs):
        pg, store = original(group_size, group_rank, global_ranks, backend, *args, **kwargs)
        if isinstance(pg, SimNCCL):
            # torch binds `device_id` to the ProcessGroup it built first, then hands back the backend itself when that
            # is a Python ProcessGroup: bind it here, as the real NCCL group keeps it (barrier reads it, new groups
            # inherit it; without it barrier warns "using the device under current context", which a box does not)
            if kwargs.get("device_id") is not None and pg.bound_device_id is None:
                pg.bound_device_id = kwargs["device_id"]
            if _nccl2.enabled():
                _nccl2.bind(pg, group_rank, global_ranks)
            pg._cpu_ok = c10d.Backend.GLOO in str(backend).lower().replace("cpu:gloo", "gloo").split(",") or \
                "cpu:gloo" in str(backend).lower()
        return pg, store

    helper._ddp_gpusim = True
    c10d._new_process_group_helper = helper
