"""Lesson 08's checker of the saved-tensor hooks: three gathered layers trained under the learner's pack/unpack."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ddp_lib import compat
from ddp_lib.check._runner import CheckResult, Mismatch, Property, learner_namespaces, max_diff, run_check
from ddp_lib.devices import comm_device, needs_process_group


def _pad_chunk(t: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
    """This rank's slice of `t` flattened and zero-padded to a multiple of ws (FSDP's layout)."""
    flat = t.detach().reshape(-1)
    return F.pad(flat, (0, -flat.numel() % ws)).chunk(ws)[rank].clone()


def _gatherer(shards: list[torch.Tensor], ws: int, dev: torch.device, live: dict[int, int], gathered: list[int]):
    """(gather(k), Gather): layer k's 6x6 weight all-gathered and registered in `live`; its autograd function."""

    def gather(k: int) -> torch.Tensor:
        buf = torch.empty(shards[k].numel() * ws, device=dev)
        compat.all_gather_single(buf, shards[k].detach())
        live[buf.untyped_storage().data_ptr()] = k
        gathered.append(k)
        return buf[:36].view(6, 6)

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, shard, k):
            ctx.k = k
            return gather(k)

        @staticmethod
        def backward(ctx, grad):
            out = torch.empty(shards[ctx.k].numel(), device=dev)
            compat.reduce_scatter_single(out, F.pad(grad.reshape(-1), (0, out.numel() * ws - 36)))
            return out / ws, None

    return gather, Gather


def _recording(learner_pack: Callable, learner_unpack: Callable, live: dict[int, int], stats: dict[str, Any]):
    """(pack, unpack) around the learner's: count what pack keeps, compare what unpack returns with the saved view."""
    saved: dict[int, tuple] = {}  # id(note) -> the view autograd saved (the checker's copy, to name mistakes)

    def pack(t: torch.Tensor) -> Any:
        out = learner_pack(t)
        held = [out] if torch.is_tensor(out) else [o for o in (out if isinstance(out, tuple) else ())
                                                   if torch.is_tensor(o)]
        if t.untyped_storage().data_ptr() not in live and not torch.is_tensor(out):
            stats["notes_for_others"] += 1
        if t.untyped_storage().data_ptr() in live:
            if any(h.numel() >= t.numel() for h in held):
                stats["kept"] += 1
                stats["kept_offsets"].append(t.storage_offset())
            saved[id(out)] = (out, tuple(t.shape), t.stride(), t.storage_offset(), t.detach().clone())
        return out

    def unpack(packed: Any) -> torch.Tensor:
        try:
            got = learner_unpack(packed)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - said as the mistake it usually is
            raise Mismatch(f"unpack raised {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}") from None
        rec = saved.get(id(packed))
        if rec is not None and rec[0] is packed:
            _name_unpack_mistake(got, *rec[1:])
        return got

    return pack, unpack


def _name_unpack_mistake(got: Any, shape: tuple, stride: tuple, offset: int, want: torch.Tensor) -> None:
    """Raise if `got` is not the view autograd saved (shape, stride, offset, values), naming how it differs."""
    if not torch.is_tensor(got) or tuple(got.shape) != shape:
        raise Mismatch(f"unpack returned {list(got.shape) if torch.is_tensor(got) else type(got).__name__} "
                       f"for a saved view of shape {list(shape)}: rebuild that view, not the whole weight")
    if not torch.equal(got.detach(), want):
        if got.stride() != stride:
            why = f"stride {got.stride()} where autograd saved {stride} (view(shape) loses a transpose)"
        elif got.storage_offset() != offset:
            why = f"storage offset {got.storage_offset()} where autograd saved a view at offset {offset}"
        else:
            why = "other values than the view autograd saved"
        raise Mismatch(f"unpack returned a tensor of shape {list(shape)} with {why}")


def _run_hooks(make_hooks: Callable, rank: int, ws: int, dev: torch.device) -> dict[str, Any]:
    """Three gathered layers trained one step under the learner's hooks, and one process's reference."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 6, bias=False).to(dev) for _ in range(3)]
    shards = [_pad_chunk(m.weight, rank, ws).requires_grad_() for m in layers]
    live: dict[int, int] = {}
    gathered: list[int] = []
    gather, Gather = _gatherer(shards, ws, dev, live, gathered)
    stats: dict[str, Any] = {"backward_gathers": [], "kept": 0, "kept_offsets": [], "notes_for_others": 0}
    pack, unpack = _recording(*make_hooks(live, gather), live, stats)
    x = torch.randn(2 * ws, 6, generator=torch.Generator().manual_seed(2)).to(dev)
    h = x.chunk(ws)[rank]
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        for k in range(3):
            W = Gather.apply(shards[k], k)
            if k == 2:  # used in two halves, as a fused weight is split: saved views at offsets 0 and 18
                h = torch.tanh(torch.cat([h @ W[:3].t(), h @ W[3:].t()], 1))
            else:
                h = torch.tanh(h @ W.t())
            live.clear()  # the layer ran: its full weight is "freed" (only a note may keep it)
    loss = h.pow(2).mean()
    n_before = len(gathered)
    loss.backward()
    stats["backward_gathers"] = sorted(set(gathered[n_before:]))
    plain = x
    for m in layers:
        plain = torch.tanh(m(plain))
    plain.pow(2).mean().backward()
    stats["grads"] = ({f"w{k}": s.grad for k, s in enumerate(shards)},
                      {f"w{k}": _pad_chunk(m.weight.grad, rank, ws) for k, m in enumerate(layers)})
    return stats


def _hooks_equal(make_hooks: Callable, *on: Any) -> float:
    """The shards' gradients under the learner's hooks against one process's."""
    s = _run_hooks(make_hooks, *on)
    if s["notes_for_others"]:
        raise Mismatch(f"pack turned {s['notes_for_others']} saved tensors that are not gathered weights "
                       "(activations) into notes: return a tensor whose storage is not in `live` as it is")
    got, want = s["grads"]
    return max_diff(got, want)


def _hooks_freed(make_hooks: Callable, *on: Any) -> None:
    """No gathered weight kept from forward to backward; backward gathers exactly the layers that saved one."""
    s = _run_hooks(make_hooks, *on)
    if s["kept"]:
        inside = " (every one a view starting inside its storage: look up t.untyped_storage().data_ptr(), " \
            "not t.data_ptr())" if all(s["kept_offsets"]) else ""
        raise Mismatch(f"pack kept {s['kept']} gathered weights (or copies) from forward to backward{inside}")
    if s["backward_gathers"] != [1, 2]:  # layers 1 and 2 save their weight; layer 0's input needs no gradient
        raise Mismatch(f"backward gathered the weights of layers {s['backward_gathers']}, expected [1, 2]")


@needs_process_group
def check_saved_tensor_hooks(make_hooks: Callable, timeout_s: float | None = None) -> CheckResult:
    """`make_hooks(live, gather)` returns `(pack, unpack)` for `saved_tensors_hooks`: a tensor that lives in a
    gathered weight (`live`: storage address -> layer) is saved as a note, and `unpack` gathers it again with
    `gather(layer)` and returns the same view; any other tensor is kept as it is."""
    on = (make_hooks, dist.get_rank(), dist.get_world_size(), comm_device())
    return run_check("check_saved_tensor_hooks", [
        Property("gradients equal one process", lambda: _hooks_equal(*on),
                 "the note keeps t.shape, t.stride() and t.storage_offset(); unpack returns "
                 "gather(layer).as_strided(shape, stride, offset): the same view autograd saved"),
        Property("weights freed between forward and backward", lambda: _hooks_freed(*on),
                 "pack looks up t.untyped_storage().data_ptr() (the storage, not t.data_ptr(): a view may start "
                 "inside it) and returns a note holding no tensor", needs=("gradients equal one process",)),
    ], timeout_s, learner_namespaces(make_hooks))
