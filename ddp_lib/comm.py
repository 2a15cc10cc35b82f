"""Collectives: the one path every collective of the engines, ZeRO-1 and FSDP takes, the helpers they share
(group by kind, broadcast rank 0's state), and lesson 01's ring all-reduce built from point-to-point sends.

The layer (FSDP2 keeps its collectives in one module of small functions too: `_fsdp_collectives.py`): each
function (`all_reduce`, `broadcast`, `all_gather_into_tensor`, `reduce_scatter_tensor`, `barrier`, ...) looks the
`torch.distributed` function up when called (so a checker's guard, the benchmarks' simulated link or a test's spy
sees it), tells the observers registered with `observe()`, adds its payload to the caller's `Tally` (calls and
bytes per kind: `comm_calls` cannot drift from what was sent) and runs under a `record_function` label while a
profiler records. `KINDS` is the one list of collective names and how a checker compares each across ranks.
Those names, the observers, the tally, the profiler labels and the tests' spies (`count_traffic`, `spy_on`) live in
`ddp_lib.comm_records`, below this module, and are importable from here too.

The ring: n ranks, the buffer cut into n chunks. Reduce-scatter, n - 1 steps: at step s rank r sends chunk
(r - s) mod n to its right neighbour and adds what its left neighbour sent into chunk (r - s - 1) mod n; afterwards
rank r holds the full sum of chunk (r + 1) mod n. All-gather, n - 1 more steps: pass the summed chunks around the
ring. Each rank sends 2(n - 1) chunks of S/n bytes: 2(n - 1)/n · S, the factor that turns algbw into busbw.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
# Imported now, before any group exists: its functions take `group=group.WORLD` as a default argument, evaluated
# when the module first loads. Loaded after init_process_group (a torch optimizer's first construction imports
# torch._dynamo, which imports it), ten defaults keep the default ProcessGroup alive, so destroy_process_group()
# cannot free it and its gloo threads run on into interpreter shutdown, where they can abort the process
# (tests/test_teardown.py).
import torch.distributed.nn.functional  # noqa: F401
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

# the layer's bookkeeping lives below it, in ddp_lib.comm_records; its public names are the layer's too
from ddp_lib.comm_records import (COLLECTIVES, KINDS, OBSERVERS, P2P, RENAMED, SENDING, Observer, Tally,  # noqa: F401
                           Traffic, compared, count_traffic, observe, phase, profiler_on, resolve, spy_on, traced)


def _issue(name: str, kind: str, payload: torch.Tensor | None, tally: Tally | None, label: str | None,
           *args: Any, **kwargs: Any) -> Any:
    """The one place a collective is issued: observed, counted once, labelled, then run."""
    # it runs once per collective, on the benchmarks' timed path too: nothing is built that a call does not need
    fn = resolve(name)
    if OBSERVERS:
        for o in list(OBSERVERS):
            o.before_collective(kind, payload, kwargs.get("group"), label)
    if tally is not None:
        tally.add(kind, payload)
    if not label:
        return fn(*args, **kwargs)
    with traced(label):  # a profiler label only while a profiler records (asked once, there)
        return fn(*args, **kwargs)


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op: bool = False, *,
               tally: Tally | None = None, label: str | None = None):
    """Reduce `tensor` over `group` in place (summed by default)."""
    return _issue("all_reduce", "all_reduce", tensor, tally, label, tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, *,
              tally: Tally | None = None, label: str | None = None):
    """Overwrite `tensor` with global rank `src`'s."""
    return _issue("broadcast", "broadcast", tensor, tally, label, tensor, src=src, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False, *,
                           tally: Tally | None = None, label: str | None = None):
    """Every rank's `input`, in rank order, into the flat `output` (payload: the output)."""
    return _issue("all_gather_into_tensor", "all_gather", output, tally, label, output, input, group=group,
                  async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False, *,
                          op=dist.ReduceOp.SUM, tally: Tally | None = None, label: str | None = None):
    """Reduce `input` over `group` (summed by default); rank r keeps slice r in `output` (payload: the input)."""
    return _issue("reduce_scatter_tensor", "reduce_scatter", input, tally, label, output, input, op=op, group=group,
                  async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group=None) -> None:
    """Rank r's `input` split along dim 0; split j goes to rank j, which stacks what it receives into `output`."""
    _issue("all_to_all_single", "all_to_all_single", input, None, None, output, input, output_split_sizes,
           input_split_sizes, group=group)


def all_gather_object(objects: list, obj: Any, group=None) -> None:
    """Every rank's picklable `obj`, in rank order, into `objects` (a list of the group's size)."""
    _issue("all_gather_object", "all_gather_object", None, None, None, objects, obj, group=group)


def barrier(group=None) -> None:
    """Wait until every rank of `group` arrives."""
    _issue("barrier", "barrier", None, None, None, group=group)


def wait_all(works: list) -> None:
    """Wait for every work in `works` (a `dist.Work`, or anything with `.wait()`), emptied first: nothing of a step
    outlives its wait, even one that raises."""
    if works:
        pending = list(works)
        works.clear()
        with phase("ddp.wait"):
            for work in pending:
                work.wait()


def grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    """The local gradient, installed as `.grad`: zeros when this rank produced none (it still takes part in the
    collective, or its peers would hang), made contiguous if not (gloo and NCCL reduce only contiguous tensors, and
    a parameter made from a transposed view gets a gradient with the same strides; a contiguous `.grad` is as good
    to autograd, which accumulates into it in place, and to the optimizer)."""
    if p.grad is None:
        p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
    elif not p.grad.is_contiguous():
        p.grad = p.grad.contiguous()
    return p.grad


def all_reduce_flat(tensors: list[torch.Tensor], group=None, divide_by: int = 1, *, tally: Tally | None = None,
                    label: str | None = None) -> None:
    """Average `tensors` in place over `group`: one flat all-reduce per dtype/device, divided by `divide_by`."""
    for same_kind in group_by_kind(tensors):
        flat = _flatten_dense_tensors(same_kind)
        flat.div_(divide_by)
        all_reduce(flat, group, tally=tally, label=label)
        for t, reduced in zip(same_kind, _unflatten_dense_tensors(flat, same_kind)):
            t.copy_(reduced)


def is_world(group) -> bool:
    """Whether `group` is the default group (None or WORLD)."""
    return group is None or group is dist.group.WORLD


class WeakGroup:
    """A process-group attribute held by a weak reference, so that an engine never keeps its group alive.

    `destroy_process_group()` drops the registry's references; a group an object still held would live on, its gloo
    threads with it, until the object died at interpreter shutdown, where a thread's end can abort the process
    ("terminate called without an active exception"). `None` (the default group, looked up at each call) is kept as
    it is; a group that was freed reads as an error, never as the default group.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, f"_weak_{name}"

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        if self.slot not in obj.__dict__:
            raise AttributeError(self.name)
        ref = obj.__dict__[self.slot]
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError(f"{type(obj).__name__}.{self.name}: its process group was destroyed "
                               "(destroy_process_group()); build a new wrapper on a live group")
        return group

    def __set__(self, obj: Any, group: Any) -> None:
        obj.__dict__[self.slot] = None if group is None else weakref.ref(group)


def group_ranks(group=None) -> tuple[int, ...]:
    """The global ranks of `group`, in group-rank order."""
    return tuple(range(dist.get_world_size())) if is_world(group) else tuple(dist.get_process_group_ranks(group))


def group_by_kind(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split tensors into lists of one dtype and device each (a flat buffer holds only one kind)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())


def broadcast_coalesced(tensors: list[torch.Tensor], src: int, group=None) -> None:
    """Overwrite `tensors` on every rank with global rank `src`'s, one flat broadcast per dtype/device."""
    for same_kind in group_by_kind(tensors):
        flat = _flatten_dense_tensors(same_kind)
        broadcast(flat, src, group)
        if dist.get_rank() != src:
            for t, new in zip(same_kind, _unflatten_dense_tensors(flat, same_kind)):
                t.copy_(new)


def group_rank0(group=None) -> int:
    """The global rank of `group`'s rank 0 (collectives name their source by global rank)."""
    return 0 if is_world(group) else dist.get_global_rank(group, 0)


def broadcast_module_state(module: nn.Module, group=None) -> None:
    """Copy rank 0's parameters (trainable and frozen) and buffers to every rank."""
    broadcast_coalesced([p.data for p in module.parameters()] + list(module.buffers()), group_rank0(group), group)

def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    """Send `send` to `right` and receive into `recv` from `left`, both posted in one group, then wait."""
    # NCCL progresses point-to-point calls that depend on each other only when they sit in one group
    # (ncclGroupStart/End, which batch_isend_irecv issues); an isend followed by a blocking recv can hang there.
    ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


def ring_allreduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` (contiguous) over all ranks, in place, with a ring of batched isend/irecv; returns `x`."""
    n, r = dist.get_world_size(), dist.get_rank()
    right, left = (r + 1) % n, (r - 1) % n
    chunks = x.view(-1).tensor_split(n)  # n views, sizes differ by at most one element
    for s in range(n - 1):  # reduce-scatter
        send, recv = chunks[(r - s) % n], chunks[(r - s - 1) % n]
        incoming = torch.empty_like(recv)
        _exchange(send, incoming, right, left)
        recv += incoming
    for s in range(n - 1):  # all-gather
        _exchange(chunks[(r + 1 - s) % n], chunks[(r - s) % n], right, left)
    return x
