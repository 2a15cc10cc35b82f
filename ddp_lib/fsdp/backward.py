"""FSDP's backward: reduce-scatter each unit's gradients (one in flight), sync everything at the end of backward
(the callback that calls `_synchronize` there is `ddp_lib.wrapper`'s)."""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddp_lib import comm
from ddp_lib.comm import group_by_kind
from ddp_lib.fsdp.units import Unit
from ddp_lib.wrapper import Step, grad_or_zeros


class BackwardMixin:
    """The gradient half of FSDP; mixed into FSDP (the forward half and the hooks live in ddp_lib/fsdp/wrapper.py)."""

    def _reduce_unit(self, u: Unit, grads: tuple) -> None:
        """The unit's gradients are complete: reduce-scatter them (or keep them, inside no_sync); free the unit."""
        self._queue_end_of_backward()
        flat = u.reduce_input(grads)  # with what no_sync steps kept
        if self.step is not Step.LOCAL:
            self._launch_reduce_scatter(u, flat)
        else:
            u.keep_local(flat)  # no_sync: full-size fp32 gradients stay on this rank, no communication
        self._free(u)

    def _launch_reduce_scatter(self, u: Unit, flat: torch.Tensor) -> None:
        self._land_reduce_scatter()  # one in flight at most: the previous full-size input goes first
        self._rs = u.reduce_scatter(flat, self.process_group, self._tally)

    def _land_reduce_scatter(self) -> None:
        if self._rs is not None:
            rs, self._rs = self._rs, None  # drops the full-size input as soon as its reduce-scatter is done
            rs.land(self.replicate_group, self.dp_size, self._tally)  # averaged over every rank (x replicas)

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
            if (flat := u.take_local()) is not None:  # accumulated under no_sync, unused in this backward
                self._launch_reduce_scatter(u, flat)
            for s in u.shards:
                if s.requires_grad:
                    grad_or_zeros(s)  # unused in this step: zeros, never a hang
        self._land_reduce_scatter()
        self._all_reduce_replicated()
        self._check_same_order()

    def _all_reduce_replicated(self) -> None:
        for same in group_by_kind([grad_or_zeros(p) for p in self.replicated]):  # zeros where unused here
            flat = _flatten_dense_tensors(same)
            # replicated on every rank: the world under HSDP
            comm.all_reduce(flat, self.sync_group, tally=self._tally, label="ddp.fsdp.allreduce.replicated")
            flat /= self.dp_size
            for t, new in zip(same, _unflatten_dense_tensors(flat, same)):
                t.copy_(new)
