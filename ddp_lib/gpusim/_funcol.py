"""torch's functional collectives (`_c10d_functional`, used by DTensor and fully_shard) on simulated CUDA tensors.

Their C++ kernels call the group's C++ methods, some of which a Python process group cannot override
(`_allgather_base`, `_reduce_scatter_base`): here each goes through torch.distributed's Python functions on the
group named, which reach the simulated NCCL group's Python methods. They complete before returning, so
`wait_tensor` returns its input. Each is issued through `ddp_lib.comm`, imported when the first one runs (the
simulation is installed before torch is imported, and `comm` imports torch and the package), so a checker's guard
sees fully_shard's collectives as it sees the package's own; they carry no `Tally`: nothing here counts them twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

fc = torch.ops._c10d_functional
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}


def _comm():
    from ddp_lib import comm  # lazily: this module loads while `import ddp_lib` is still running

    return comm


def _group(name):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _gather(x, group_size, name):
    out = x.new_empty((x.shape[0] * group_size, *x.shape[1:]))
    _comm().all_gather_into_tensor(out, x.contiguous(), _group(name))
    return out


def _scatter(x, op, group_size, name):
    out = x.new_empty((x.shape[0] // group_size, *x.shape[1:]))
    _comm().reduce_scatter_tensor(out, x.contiguous(), _group(name), op=_OPS[op.lower()])
    return out


def _reduce_(x, op, name):
    _comm().all_reduce(x, _group(name), op=_OPS[op.lower()])
    return x


def _broadcast_(x, src, name):
    group = _group(name)
    _comm().broadcast(x, dist.get_global_rank(group, src), group)
    return x


def _all_to_all(x, out_splits, in_splits, name):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    _comm().all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), _group(name))
    return out


IMPLS = {
    fc.all_gather_into_tensor.default: _gather,
    fc.reduce_scatter_tensor.default: _scatter,
    fc.all_reduce.default: lambda x, op, name: _reduce_(x.clone(), op, name),
    fc.all_reduce_.default: _reduce_,
    fc.broadcast.default: lambda x, src, name: _broadcast_(x.clone(), src, name),
    fc.broadcast_.default: _broadcast_,
    fc.all_to_all_single.default: _all_to_all,
    fc.wait_tensor.default: lambda x: x,
    fc.all_gather_into_tensor_coalesced.default: lambda xs, n, name: [_gather(x, n, name) for x in xs],
    fc.reduce_scatter_tensor_coalesced.default: lambda xs, op, n, name: [_scatter(x, op, n, name) for x in xs],
    fc.all_reduce_coalesced.default: lambda xs, op, name: [_reduce_(x.clone(), op, name) for x in xs],
}
