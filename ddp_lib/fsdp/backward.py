"""FSDP's backward: reduce-scatter each unit's gradients (one in flight), sync everything at the end of backward
(the callback that calls `_synchronize` there is `ddp_lib.wrapper`'s)."""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lib import comm
from ddp_lib.comm import group_by_kind
from ddp_lib.fsdp.hsdp import all_reduce_replicas
from ddp_lib.fsdp.units import Unit
from ddp_lib.profiling import phase


class BackwardMixin:
    """The gradient half of FSDP; mixed into FSDP (the forward half and the hooks live in ddp_lib/fsdp/wrapper.py)."""

    def _reduce_unit(self, u: Unit, grads: tuple) -> None:
        """The unit's gradients are complete: reduce-scatter them (or keep them, inside no_sync); free the unit."""
        self._queue_end_of_backward()
        flat = u.grad_input(grads)  # summed in fp32: a bf16 sum over ranks would round every partial sum
        if u.accum is not None:
            flat += u.accum
            u.accum = None
        if self._sync_this_backward:
            self._launch_reduce_scatter(u, flat)
        else:
            u.accum = flat  # no_sync: full-size fp32 gradients stay on this rank, no communication
        self._free(u)

    def _launch_reduce_scatter(self, u: Unit, flat: torch.Tensor) -> None:
        self._land_reduce_scatter()  # one in flight at most: the previous full-size input goes first
        out = torch.empty(u.trainable_numel, dtype=torch.float32, device=flat.device)
        work = comm.reduce_scatter_tensor(out, flat, self.process_group, async_op=True, tally=self._tally,
                                          label=f"ddp.fsdp.reduce_scatter.{u.name}")
        self._rs = (work, out, flat, u)

    def _land_reduce_scatter(self) -> None:
        if self._rs is not None:
            work, out, _, u = self._rs
            self._rs = None  # drops the full-size input as soon as its reduce-scatter is done
            with phase(f"ddp.fsdp.wait_reduce_scatter.{u.name}"):
                work.wait()
            if self.replicate_group is not None:  # HSDP: the replicas holding this chunk add theirs
                all_reduce_replicas(out, self.replicate_group, self._tally)
            u.fold(out, self.dp_size)  # the average over every rank (shard size x replicas under HSDP)

    def _after_unit_backward(self, u: Unit) -> None:
        self._queue_end_of_backward()
        self._free(u)

    def _after_backward(self) -> None:
        self._free_all()  # after a no_sync backward too

    def _synchronize(self) -> None:
        """Backward ended: land the last reduce-scatter, reduce what no_sync kept or nobody used, all-reduce
        the replicated gradients."""
        self._free_all()
        self._land_reduce_scatter()
        for u in dict.fromkeys(self.units.values()):
            if u.accum is not None:  # accumulated under no_sync, unused in this backward
                flat, u.accum = u.accum, None
                self._launch_reduce_scatter(u, flat)
            for s in u.shards:
                if s.requires_grad and s.grad is None:  # unused in this step: zeros, never a hang
                    s.grad = torch.zeros_like(s)
        self._land_reduce_scatter()
        self._all_reduce_replicated()
        self._check_same_order()

    def _all_reduce_replicated(self) -> None:
        for p in self.replicated:
            if p.grad is None:  # unused in this step on this rank: contribute zeros, never hang
                p.grad = torch.zeros_like(p)
        for same in group_by_kind([p.grad for p in self.replicated]):
            flat = _flatten_dense_tensors(same)
            # replicated on every rank: the world under HSDP
            comm.all_reduce(flat, self.sync_group, tally=self._tally, label="ddp.fsdp.allreduce.replicated")
            flat /= self.dp_size
            for t, new in zip(same, _unflatten_dense_tensors(flat, same)):
                t.copy_(new)
