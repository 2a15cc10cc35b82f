"""A simulated NCCL process group: CUDA tensors only, carried over an internal gloo group on their CPU data.

Installed as `torch.distributed.distributed_c10d.ProcessGroupNCCL`, so `init_process_group("nccl")` and
`"cpu:gloo,cuda:nccl"` build it where torch builds NCCL. It is a Python `ProcessGroup` (torch's PyProcessGroup
trampoline), so torch DDP's C++ reducer and `torch.distributed`'s Python API both reach its methods. A CPU tensor
in a group without gloo raises the error torch's ProcessGroup::getBackend raises for a device type it has no
backend for; with "cpu:gloo,cuda:nccl" CPU tensors go to gloo. `wait()` returns once the data has arrived, but,
as under NCCL, `is_completed()` stays False until the host synchronizes with the device (torch.cuda.synchronize).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo, PrefixStore

from ddp_lib.gpusim import _box, _dry, _nccl2
from ddp_lib.gpusim._tensor import SimCudaTensor
from ddp_lib.gpusim._work import Options, SimWork, _Chain

_RedOp = dist.ReduceOp.RedOpType


def _is_meta(t) -> bool:
    """Whether a simulated tensor holds no data (dry mode)."""
    return getattr(t, "_inner", t).is_meta


def _flat(tensors) -> list:
    out = []
    for t in tensors:
        out.extend(_flat(t) if isinstance(t, (list, tuple)) else [t])
    return out


class _BackendInfo:
    """What distributed_c10d asks of a group's NCCL backend: it splits (ncclCommSplit: once
    `init_process_group(device_id=...)` bound the default group, DeviceMesh builds its groups with `split_group`, and
    new_group hands this backend to the new group as `split_from`), it does not coalesce."""

    supports_splitting = True
    supports_coalescing = False

    def __init__(self, group: "SimNCCL") -> None:
        self._group = group
        self.options = group.options

    def name(self) -> str:
        """The backend's name."""
        return "nccl"

    def comm_split_count(self) -> int:
        """How many groups were split from this one (torch names a split group's description with it)."""
        return self._group._splits

    def perform_nocolor_split(self, device) -> None:  # noqa: ARG002
        """A rank outside a new group takes part in NCCL's split; the simulated groups rendezvous on the store."""

    def eager_connect_single_device(self, device) -> None:  # noqa: ARG002
        """NCCL connects a bound group at once; the simulated group's gloo connected when it was built."""

    def _set_sequence_number_for_group(self) -> None:
        """Sequence numbers are gloo's, inside."""


class SimNCCL(dist.ProcessGroup):
    """ProcessGroupNCCL's stand-in: the collectives of torch.distributed on simulated CUDA tensors."""

    Options = Options

    def __init__(self, store, rank: int, size: int, options: Options | None = None, cpu_ok: bool = False) -> None:
        super().__init__(rank, size)
        self.options = options or Options()
        timeout = self.options._timeout
        self._store = store
        self._gloo = ProcessGroupGloo(PrefixStore("ddp_gpusim/", store), rank, size, timeout)
        self._cpu_ok = cpu_ok
        self._coalescing = False
        self._host_next = False  # the next work blocks the host (CPU tensors in it)
        self._splits = 0

    # -- what torch.distributed asks of a ProcessGroupNCCL ---------------------------------------
    def getBackendName(self) -> str:  # noqa: N802
        """The backend's name."""
        return "nccl"

    def name(self) -> str:
        """The backend's name."""
        return "nccl"

    # a Python ProcessGroup without backends keeps its name and description here (PyProcessGroup's overrides)
    def setGroupName(self, name: str) -> None:  # noqa: N802
        """Set by distributed_c10d when the group is created."""
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        """The group's name (DeviceMesh and functional collectives look groups up by it)."""
        return getattr(self, "_group_name", "")

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        """Set by distributed_c10d when the group is created."""
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        """The group's description."""
        return getattr(self, "_group_desc", "")

    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu"), torch.device("cuda")] if self._cpu_ok else [torch.device("cuda")]

    def _set_sequence_number_for_group(self) -> None:
        """Sequence numbers are gloo's, inside."""

    def _get_sequence_number_for_group(self) -> int:
        """The group's sequence number, whose change over a cell the magics compare across ranks: its inner gloo
        group's count of operations. That counts collectives as ProcessGroupNCCL's `seqCollective_` does, but also
        point-to-point operations (NCCL counts those apart, `seqP2P_`), and a coalesced gather or reduce-scatter once
        per tensor here (gloo runs one op per tensor): the same count as on the CPU path's gloo groups, so ranks
        that issued the same operations agree. Without this override the base ProcessGroup raises "does not yet
        support sequence numbers" and the check would silently leave every simulated NCCL group out."""
        return int(self._gloo._get_sequence_number_for_group())

    def _shutdown(self) -> None:
        """Nothing to tear down beyond the gloo group."""

    def abort(self) -> None:
        """As _shutdown."""

    def _get_backend(self, device):  # noqa: ARG002
        """What distributed_c10d asks of the device's backend (`_BackendInfo`)."""
        return _BackendInfo(self)

    def get_group_store(self):
        """The store this group was built on (split_group registers a split group with it)."""
        return self._store

    def split_group(self, ranks: list[int], timeout=None, opts=None, group_name: str | None = None,
                    group_desc: str | None = None, device_types=None) -> "SimNCCL | None":  # noqa: ARG002
        """ProcessGroup.split_group (ncclCommSplit): a group of `ranks` (ranks of this group), or None on a rank
        outside them; its own gloo group rendezvouses on this group's store under the new group's name."""
        self._splits += 1
        if self.rank() not in ranks:
            return None
        options = opts if opts is not None else Options()
        if timeout is not None:
            options._timeout = timeout
        child = SimNCCL(PrefixStore(f"split/{group_name}/", self._store), ranks.index(self.rank()), len(ranks),
                        options, cpu_ok=self._cpu_ok)
        child.setGroupName(group_name or "")
        if hasattr(self, _nccl2.ORIGIN):  # a split group keeps its parent's device (torch binds it after the split)
            setattr(child, _nccl2.ORIGIN, getattr(self, _nccl2.ORIGIN))
        child.setGroupDesc(group_desc or "")
        return child

    # -- tensors ---------------------------------------------------------------------------------
    def _work(self, gloo_work, result: list, after=None) -> SimWork:
        # a collective on CPU tensors is gloo's: its wait blocks the host
        host, self._host_next = self._host_next, False
        return SimWork(gloo_work, result, after, host=host)

    def _inner(self, tensors) -> list:
        _box.drain()  # the collectives before this one, on the same stream, first
        out = []
        for t in _flat(tensors):
            if isinstance(t, SimCudaTensor):
                out.append(t._inner)
            elif self._cpu_ok and t.device.type == "cpu":
                self._host_next = True
                out.append(t)
            else:  # ProcessGroup::getBackend's error for a device type without a backend (ProcessGroup.cpp)
                raise RuntimeError(f"No backend type associated with device type {t.device.type}")
        # dry mode: a tensor without data goes as a one-element stand-in, so every rank still meets, in order
        return [_dry.standin(t) if t.is_meta else t for t in out]

    def _pair(self, output, input, scale: int):  # noqa: A002
        """The inner tensors of a gather or scatter into one tensor (`output` `scale` times `input`'s size for a
        gather); in dry mode, where either has no data, stand-ins of 1 and `scale` elements."""
        (out,), (inp,) = self._inner([output]), self._inner([input])
        if _dry.enabled and (_is_meta(output) or _is_meta(input)):
            out, inp = (_dry.standin(out, scale), _dry.standin(inp)) if scale > 0 else \
                (_dry.standin(out), _dry.standin(inp, -scale))
        return out, inp

    def _unflat(self, like, flat: list):
        it = iter(flat)

        def build(x):
            return [build(y) for y in x] if isinstance(x, (list, tuple)) else next(it)
        return [build(x) for x in like]

    def _avg(self, opts, outputs, n):
        # gloo has no AVG: NCCL's average is a sum divided by the group size, done when the data arrives
        op = opts.reduceOp.op if hasattr(opts.reduceOp, "op") else opts.reduceOp
        if op == _RedOp.AVG:
            opts.reduceOp = dist.ReduceOp.SUM
            return lambda: [t.div_(n) for t in outputs]
        if op == _RedOp.PREMUL_SUM:
            raise RuntimeError("not simulated: ReduceOp.PREMUL_SUM (NCCL's pre-multiplied sum)")
        return None

    def allreduce(self, tensors, opts=None):
        """All-reduce every tensor in place."""
        opts = opts or dist.AllreduceOptions()
        inner = self._inner(tensors)
        after = self._avg(opts, inner, self.size())
        return self._work(self._gloo.allreduce(inner, opts), list(tensors), after)

    def allreduce_coalesced(self, tensors, opts=None):
        """All-reduce a list of tensors as one operation."""
        opts = opts or dist.AllreduceCoalescedOptions()
        inner = self._inner(tensors)
        after = self._avg(opts, inner, self.size())
        return self._work(self._gloo.allreduce_coalesced(inner, opts), list(tensors), after)

    def broadcast(self, tensors, opts=None):
        """Broadcast from opts.rootRank."""
        return self._work(self._gloo.broadcast(self._inner(tensors), opts or dist.BroadcastOptions()), list(tensors))

    def allgather(self, output_lists, inputs, opts=None):
        """Gather every rank's tensor into each rank's list."""
        outs = self._unflat(output_lists, self._inner(output_lists))
        work = self._gloo.allgather(outs, self._inner(inputs), opts or dist.AllgatherOptions())
        return self._work(work, output_lists)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002
        """all_gather_into_tensor."""
        out, inp = self._pair(output, input, self.size())
        return self._work(self._gloo._allgather_base(out, inp, opts or dist.AllgatherOptions()), [output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """Several all_gather_into_tensor as one."""
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return _Chain(works, list(outputs))

    def reduce_scatter(self, outputs, input_lists, opts=None):
        """Reduce the lists and scatter the result, one tensor per rank."""
        opts = opts or dist.ReduceScatterOptions()
        outs, ins = self._inner(outputs), self._unflat(input_lists, self._inner(input_lists))
        after = self._avg(opts, outs, self.size())
        return self._work(self._gloo.reduce_scatter(outs, ins, opts), list(outputs), after)

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        """reduce_scatter_tensor."""
        opts = opts or dist.ReduceScatterOptions()
        out, inp = self._pair(output, input, -self.size())
        after = self._avg(opts, [out], self.size())
        return self._work(self._gloo._reduce_scatter_base(out, inp, opts), [output], after)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """Several reduce_scatter_tensor as one."""
        return _Chain([self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)], list(outputs))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        """all_to_all_single."""
        (out,), (inp,) = self._inner([output]), self._inner([input])
        if _dry.enabled and (_is_meta(output) or _is_meta(input)):
            out, inp = _dry.standin(out, self.size()), _dry.standin(inp, self.size())
            output_split_sizes = input_split_sizes = []
        work = self._gloo.alltoall_base(out, inp, output_split_sizes, input_split_sizes, opts or dist.AllToAllOptions())
        return self._work(work, [output])

    def reduce(self, tensors, opts=None):
        """Reduce onto opts.rootRank."""
        opts = opts or dist.ReduceOptions()
        inner = self._inner(tensors)
        after = self._avg(opts, inner, self.size())
        return self._work(self._gloo.reduce(inner, opts), list(tensors), after)

    def gather(self, output_lists, inputs, opts=None):
        """Gather onto opts.rootRank."""
        outs = self._unflat(output_lists, self._inner(output_lists))
        return self._work(self._gloo.gather(outs, self._inner(inputs), opts or dist.GatherOptions()), output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        """Scatter from opts.rootRank."""
        ins = self._unflat(input_lists, self._inner(input_lists))
        return self._work(self._gloo.scatter(self._inner(outputs), ins, opts or dist.ScatterOptions()), outputs)

    def send(self, tensors, dst: int, tag: int = 0):
        """Point-to-point send."""
        return self._work(self._gloo.send(self._inner(tensors), dst, tag), list(tensors))

    def recv(self, tensors, src: int, tag: int = 0):
        """Point-to-point receive."""
        return self._work(self._gloo.recv(self._inner(tensors), src, tag), list(tensors))

    def recv_anysource(self, tensors, tag: int = 0):
        """NCCL cannot receive from any source."""
        raise RuntimeError("ProcessGroupNCCL does not support recvAnysource")

    # the names torch.distributed's Python functions call (distributed_c10d.py), beside the C++ ones
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced
    all_to_all_single = alltoall_base

    def alltoall(self, outputs, inputs, opts=None):
        """all_to_all with lists: not carried by the simulation."""
        raise RuntimeError("not simulated: all_to_all with tensor lists (use all_to_all_single)")

    def barrier(self, opts=None):
        """A barrier (NCCL: an all-reduce of one element on the current device)."""
        return SimWork(self._gloo.barrier(opts or dist.BarrierOptions()), [], host=True)  # NCCL's barrier blocks


def install() -> None:
    """Make torch.distributed build SimNCCL wherever it would build ProcessGroupNCCL."""
    import torch.distributed.distributed_c10d as c10d

    c10d.ProcessGroupNCCL = SimNCCL
    # c10d_logger reports the NCCL version with every collective's error: (0, 0, 0) says none is real here
    torch.cuda.nccl.version = lambda: (0, 0, 0)
    c10d.is_nccl_available = dist.is_nccl_available = lambda: True
    c10d._NCCL_AVAILABLE = True
