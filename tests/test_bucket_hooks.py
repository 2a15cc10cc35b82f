"""BucketedDDP hooks one gradient per bucket once its plan is rebuilt, and only launches a bucket it can prove full.

Each synchronizing step is compared bit for bit with the average computed by hand (the local gradients of a plain
copy of the model, all-reduced and divided by the world size). Two gloo ranks; every rank body returns what the
test asserts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ddp_lib.ddp import BucketedDDP
from ddp_lib.launch import spawn


class Chain(nn.Module):
    """Four square layers; `order` picks the order they run in (so the order gradients arrive in), `reentrant`
    runs the first layer twice, once inside a reentrant checkpoint (its gradient then arrives twice)."""

    def __init__(self, spare: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.order, self.reentrant = [0, 1, 2, 3], False
        if spare:
            self.spare = nn.Linear(64, 64)  # never used: its gradients never arrive

    def forward(self, x):
        if self.reentrant:
            x = self.layers[0](checkpoint(self.layers[0], x.detach().requires_grad_(), use_reentrant=True))
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return x


def _setup(spare: bool = False):
    torch.manual_seed(0)
    model = Chain(spare)
    plain = copy.deepcopy(model)
    ddp = BucketedDDP(model, bucket_size_mb=0.03, first_bucket_mb=0.03)  # 2 buckets of 2 layers
    calls = []
    grad_ready = ddp.sync.on_grad

    def counted(p, k):  # what each hook call hands the engine, and how far launches got after it
        grad_ready(p, k)
        calls.append(ddp.sync.next)

    ddp.sync.on_grad = counted
    return model, plain, ddp, calls


def _expected(plain: nn.Module, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The averaged gradients of this step, by hand: the plain copy (given the model's current parameters)."""
    plain.load_state_dict(model.state_dict())
    plain.order, plain.reentrant = model.order, model.reentrant
    plain.zero_grad(set_to_none=True)
    plain(x).pow(2).sum().backward()
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in plain.parameters()]
    for g in grads:
        dist.all_reduce(g)
        g.div_(dist.get_world_size())
    return grads


def _step(model, plain, ddp, calls, opt, x, *, zero_before_backward: bool = False) -> dict:
    want = _expected(plain, model, x)
    calls.clear()
    loss = ddp(x).pow(2).sum()
    if zero_before_backward:
        opt.zero_grad(set_to_none=True)  # after the forward: the gradients bound to the buckets are dropped
    loss.backward()
    reduced = ddp.step.name  # REDUCED: backward's end synchronized, as the wrapper's contract says
    ddp.finish_gradient_synchronization()
    same = all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    row = {"same": same, "hook_calls": len(calls), "launched_in_hooks": max(calls, default=0),
           "hooks": len(ddp._hooks), "buckets": len(ddp.buckets), "after_backward": reduced}
    opt.step()
    return row


def _rebuilt():
    """`_setup` plus an optimizer and this rank's batch, after 3 synchronized steps: the plan rebuilt, per bucket."""
    model, plain, ddp, calls = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    for _ in range(3):
        opt.zero_grad()
        _step(model, plain, ddp, calls, opt, x)
    return model, plain, ddp, calls, opt, x


def rank_steps(case: str) -> list[dict]:
    model, plain, ddp, calls = _setup(spare=case == "spare")
    if case == "rank_order" and dist.get_rank() == 1:
        model.order = [1, 0, 2, 3]  # here layer 0's gradients arrive before layer 1's: not rank 0's order
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    rows = []
    for step in range(6):
        if case == "set_to_none":
            opt.zero_grad(set_to_none=True)  # torch's default: every step starts with no .grad at all
        else:
            opt.zero_grad(set_to_none=False)
        if case == "order" and step == 3:
            model.order = [1, 0, 2, 3]  # layer 0's gradients now arrive before layer 1's, its bucket-mate's
        elif case == "order" and step == 4:
            model.order = [0, 1, 2, 3]
        rows.append(_step(model, plain, ddp, calls, opt, x, zero_before_backward=case == "zero_late" and step == 3))
    return rows


def test_after_the_rebuild_each_bucket_is_hooked_once_and_launched_from_its_hook():
    for rows in spawn(rank_steps, world_size=2, args=("plain",)):
        assert all(r["same"] and r["after_backward"] == "REDUCED" for r in rows), rows
        assert rows[0]["hook_calls"] == 8 and rows[0]["hooks"] == 8, rows[0]  # step 1: one per gradient
        for r in rows[1:]:  # the plan is rebuilt at the second synchronizing forward
            assert r["hooks"] == r["buckets"] == 2 and r["hook_calls"] == 2, r
            assert r["launched_in_hooks"] == 2, r  # both buckets went out during backward, not at its end


def test_each_rank_hooks_the_gradient_that_arrived_last_on_it():
    """The plan follows rank 0's order; on rank 1 layer 0's gradients come before layer 1's, its bucket-mate's, so
    its hook sits on another parameter than rank 0's, and the count adds up on both."""
    for rows in spawn(rank_steps, world_size=2, args=("rank_order",)):
        assert all(r["same"] and r["after_backward"] == "REDUCED" for r in rows), rows
        assert all(r["hooks"] == 2 and r["hook_calls"] == 2 and r["launched_in_hooks"] == 2 for r in rows[1:]), rows


def test_a_parameter_without_a_gradient_keeps_one_hook_per_gradient():
    """A bucket holding a parameter that got no gradient in the first step could never count full, and a hook on
    that parameter would never fire: such a model stays on one hook per gradient, and backward's end still
    synchronizes."""
    for rows in spawn(rank_steps, world_size=2, args=("spare",)):
        assert all(r["same"] and r["after_backward"] == "REDUCED" for r in rows), rows
        assert all(r["hooks"] == 10 and r["hook_calls"] == 8 for r in rows), rows


def test_zero_grad_set_to_none_keeps_one_hook_per_bucket():
    """The optimizer's default drops every .grad: the forward binds them back to the buffer, zeroed."""
    for rows in spawn(rank_steps, world_size=2, args=("set_to_none",)):
        assert all(r["same"] for r in rows), rows
        assert all(r["hook_calls"] == 2 and r["launched_in_hooks"] == 2 for r in rows[1:]), rows


@pytest.mark.parametrize("case", ["order", "zero_late"])
def test_gradients_that_break_the_count_wait_for_backward_end_then_every_gradient_is_hooked(case):
    """Gradients in another order, or the .grad bound to the bucket dropped between forward and backward: the
    bucket's count does not add up, so it is sent when backward ends (right, not overlapped), and from the next
    step the engine hooks every gradient again."""
    for rows in spawn(rank_steps, world_size=2, args=(case,)):
        assert all(r["same"] for r in rows), rows
        assert rows[2]["hooks"] == 2 and rows[3]["hooks"] == 8, rows  # step 4 broke the count: per gradient after
        assert rows[3]["launched_in_hooks"] < 2, rows[3]
        assert all(r["hook_calls"] == 8 and r["launched_in_hooks"] == 2 for r in rows[4:]), rows


def rank_no_sync() -> bool:
    """A no_sync step between per-bucket steps: its local gradient lives in the views and joins the next average."""
    model, plain, ddp, calls, opt, x = _rebuilt()
    opt.zero_grad()
    plain.load_state_dict(model.state_dict())
    plain.zero_grad(set_to_none=True)
    for _ in range(2):
        plain(x).pow(2).sum().backward()
    want = [p.grad.clone() for p in plain.parameters()]
    for g in want:
        dist.all_reduce(g)
        g.div_(2)
    with ddp.no_sync():
        ddp(x).pow(2).sum().backward()
    calls.clear()
    ddp(x).pow(2).sum().backward()
    ddp.finish_gradient_synchronization()
    return calls == [1, 2] and all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))


def test_a_no_sync_step_between_per_bucket_steps_joins_the_next_average():
    assert all(spawn(rank_no_sync, world_size=2))


def rank_late_gradient(case: str) -> dict:
    model, plain, ddp, calls, opt, x = _rebuilt()
    opt.zero_grad()
    handle = None
    if case == "twice":
        model.reentrant = True  # layer 0's gradient now arrives twice: the second after its bucket was sent
    else:  # once layer 1's gradient is in (bucket 0, layers 3 and 2, was sent before), layer 3's .grad is replaced
        last = model.layers[3].weight

        def replace(p):
            last.grad = last.grad.clone()
        handle = model.layers[1].weight.register_post_accumulate_grad_hook(replace)
    try:
        ddp(x).pow(2).sum().backward()
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    row = {"error": error, "in_flight": len(ddp.sync.works), "hooks": len(ddp._hooks)}
    model.reentrant = False
    if handle is not None:
        handle.remove()
    opt.zero_grad()
    row["after"] = _step(model, plain, ddp, calls, opt, x)
    return row


@pytest.mark.parametrize("case", ["twice", "replaced"])
def test_a_gradient_after_its_bucket_was_sent_is_a_clear_error_and_nothing_stays_in_flight(case):
    """A gradient added to a sent bucket (its version moved), or a .grad that is no longer the bucket's view (the
    version cannot see that): the bucket's average missed something, so backward's end raises."""
    for row in spawn(rank_late_gradient, world_size=2, args=(case,)):
        assert "changed after the bucket was sent" in row["error"] and "use_reentrant=False" in row["error"], row
        assert row["in_flight"] == 0 and row["hooks"] == 8, row
        assert row["after"]["same"], row


def rank_comm_hook_after_rebuild() -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model, plain, ddp, calls, opt, x = _rebuilt()
    ddp.register_comm_hook(None, allreduce_hook)  # it writes the buffer when its future completes: per gradient
    opt.zero_grad()
    return _step(model, plain, ddp, calls, opt, x)


def test_a_comm_hook_puts_the_engine_back_on_one_hook_per_gradient():
    for row in spawn(rank_comm_hook_after_rebuild, world_size=2):
        assert row["hooks"] == 8 and row["hook_calls"] == 8 and row["same"], row
