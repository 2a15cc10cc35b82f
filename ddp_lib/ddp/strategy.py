"""What a DDP engine's sync strategy is: the few verbs the front (`ddp_lib/contract.py`) calls, and their helpers.

An engine (`NaiveDDP`, `FlatDDP`, `OverlapDDP`, `BucketedDDP`) is the front given one strategy. The front owns the
contract (step state, `no_sync`, the end-of-backward callback, hooks, re-wrap, counts, the init broadcast) and calls:
- `prepare()`: a synchronizing forward, before the module runs (rank 0's buffers broadcast first);
- `on_grad(p, k)`: the gradient of `p = hooked[k]` was accumulated, and this backward reduces it;
- `finish()`: backward ended (or `finish_gradient_synchronization()`): every trainable `.grad` becomes the average;
- `land()`: wait for what an interrupted backward left in flight (before a forward, and on detach).
`hooked` lists the parameters whose gradients the strategy wants to hear about (the front hooks them, and hooks the
new list whenever the strategy replaces it); `divide_by` is what each gradient is divided by (the world size; under
`join()` the ranks with data). A strategy's collectives go through `ddp_lib.comm` with `tally=self.tally`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ddp_lib import comm
from ddp_lib.comm import Tally, grad_or_zeros  # noqa: F401 (the strategies take it from here)
from ddp_lib.ddp.join import Join
from ddp_lib.devices import comm_device

__all__ = ["SyncStrategy", "grad_or_zeros", "TWICE"]

#: a hook strategy's error when one parameter's gradient arrives twice in one backward
TWICE = ("marked ready twice in one backward: its gradient was produced by two separate backward passes "
         "(reentrant checkpointing? use torch.utils.checkpoint with use_reentrant=False)")


class SyncStrategy:
    """How one engine averages gradients over `group`; the verbs do nothing until a strategy says otherwise."""

    group = comm.WeakGroup()  # held weakly: destroy_process_group() frees it

    def __init__(self, module: nn.Module, trainable: list[nn.Parameter], group, tally: Tally,
                 buffers: list[torch.Tensor]):
        self.module, self.trainable, self.group, self.tally = module, trainable, group, tally
        self.buffers = buffers  # broadcast from rank 0 at each synchronizing forward (empty: broadcast_buffers=False)
        self.divide_by = dist.get_world_size(group)
        self.hooked: list[nn.Parameter] = []  # a strategy that reduces after backward hears of no gradient
        self.setup_due = False  # under join(): some rank runs a setup collective at this step, so every rank must

    def prepare(self) -> None:
        """A synchronizing forward is about to run the module: rank 0's buffers first (strategies extend this)."""
        if self.buffers:
            comm.broadcast_coalesced(self.buffers, comm.group_rank0(self.group), self.group)

    def on_grad(self, p: nn.Parameter, k: int) -> None:
        """`p = hooked[k]`'s gradient arrived in a synchronizing backward (once per parameter per backward)."""

    def finish(self) -> None:
        """Backward ended: make every trainable gradient the rank average."""
        raise NotImplementedError

    def land(self) -> None:
        """Wait for the reductions an interrupted backward left in flight."""

    def join_part(self, divide_by_initial_world_size: bool) -> Join:
        """The state of one `join()` block over this strategy's group (`ddp_lib/ddp/join.py`)."""
        return Join(self.group, dist.get_world_size(self.group), divide_by_initial_world_size)

    def wants_setup(self) -> bool:
        """Whether this rank will run a setup collective at its next synchronizing forward (join() tells the rest)."""
        return False

    # a strategy's collectives go through these, so that a step enters the collectives layer from one module
    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, label: str = "ddp.allreduce"):
        """All-reduce `tensor` (summed) over the group, counted in the engine's `comm_calls`."""
        return comm.all_reduce(tensor, self.group, async_op=async_op, tally=self.tally, label=label)

    def rank0s(self, values: list[int]) -> list[int]:
        """The group's first rank's `values` (as long as this rank's), on every rank (bookkeeping: not counted)."""
        tensor = torch.tensor(values, dtype=torch.long, device=comm_device(self.group))
        comm.broadcast(tensor, comm.group_rank0(self.group), self.group)
        return tensor.tolist()

    def wait_all(self, works: list) -> None:
        """Wait for every work in `works`, emptied first (`comm.wait_all`)."""
        comm.wait_all(works)
