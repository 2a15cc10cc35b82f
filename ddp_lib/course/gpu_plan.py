"""Memory plans on the meta device: the peak a lesson's GPU-size step reaches on one rank, without a GPU.

`peak_gib(step)` runs `step()` with every tensor on the meta device (shapes and dtypes, no storage) under a
dispatch mode that adds each new storage's bytes when an op creates it and subtracts them when it is freed, as
the CUDA caching allocator's `memory_allocated` counts tensors. The lessons' real sizes are planned once here
(`PLANS`), their peaks are committed in `ddp_lib.course.gpu_needs.NEED_GIB`, and a unit test re-plans them and
checks which GPU profile each fits (`tests/test_gpu_plan.py`). Not counted: the CUDA context, cuBLAS
workspaces, NCCL's buffers and the allocator's fragmentation (the headroom of `ddp_lib.devices.fits_gpu`).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GiB = 2**30


class PeakBytes(TorchDispatchMode):
    """Live and peak bytes of the storages the ops under it create (and of those `add`ed before)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        """Count a tensor's storage once, until it is freed."""
        st = t.untyped_storage()
        key = st._cdata  # the StorageImpl's address: unique while it is alive
        if key in self.live:
            return
        self.live[key] = st.nbytes()
        self.now += st.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


def peak_gib(step: Callable[[PeakBytes], None]) -> float:
    """Peak GiB of `step(tracker)`, run on the meta device; `step` may `tracker.add` what it built before."""
    tracker = PeakBytes()
    with torch.device("meta"), tracker:
        step(tracker)
    return tracker.peak / GiB


def _lm_sgd(preset: str, sequences: int, seq: int) -> Callable[[PeakBytes], None]:
    # lesson 02: SGD steps, the simple class's all-reduces work in place
    def step(_: PeakBytes) -> None:
        from ddp_lib.kit.models import TransformerLM, lm_loss

        model = TransformerLM(preset)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, model.cfg.vocab_size, (sequences, seq + 1))
        for _ in range(2):
            opt.zero_grad()
            lm_loss(model, tokens).backward()
            opt.step()
    return step


def _lm_flat_sync(preset: str) -> Callable[[PeakBytes], None]:
    # lesson 04: random gradients on the weights, then FlatDDP's flat copy of them beside the gradients
    def step(_: PeakBytes) -> None:
        from torch._utils import _flatten_dense_tensors

        from ddp_lib.kit.models import TransformerLM

        model = TransformerLM(preset)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        flat = _flatten_dense_tensors([p.grad for p in model.parameters()])
        del flat
    return step


def _lm_adamw_bucketed(preset: str, sequences: int, seq: int) -> Callable[[PeakBytes], None]:
    # lesson 07: BucketedDDP's persistent flat buckets (one copy of the gradients) and AdamW's two moments
    def step(_: PeakBytes) -> None:
        from ddp_lib.kit.models import TransformerLM, lm_loss

        model = TransformerLM(preset)
        buckets = torch.empty(sum(p.numel() for p in model.parameters()))
        # foreach: CUDA's default, as lesson 07 runs it, whose step holds a parameter-sized temporary
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        tokens = torch.randint(0, model.cfg.vocab_size, (sequences, seq + 1))
        for _ in range(2):  # the optimizer state is allocated by the first step
            opt.zero_grad()
            lm_loss(model, tokens).backward()
            opt.step()
        del buckets
    return step


def _lm_race_bucketed(preset: str, sequences: int, seq: int) -> Callable[[PeakBytes], None]:
    # lesson 05's race: the reference variant's final parameters (`base`: kept on the device) and one variant's copy,
    # its gradients as views into BucketedDDP's flat buckets, and the rebuild after the first backward, which
    # allocates the new buckets while the old ones live
    def step(_: PeakBytes) -> None:
        import copy

        from ddp_lib.kit.models import TransformerLM, lm_loss

        base = TransformerLM(preset)
        model = copy.deepcopy(base)
        numel = sum(p.numel() for p in model.parameters())
        buckets = torch.empty(numel)
        offset = 0
        for p in model.parameters():
            p.grad = buckets[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, model.cfg.vocab_size, (sequences, seq + 1))
        lm_loss(model, tokens).backward()
        rebuilt = torch.empty(numel)  # the rebuilt plan's buffer, the old one still alive
        rebuilt.copy_(buckets)
        del buckets
        opt.step()
    return step


def _smollm2_adamw(pairs: int, seq: int) -> Callable[[PeakBytes], None]:
    # lesson 06: SmolLM2-360M's shape (random weights), AdamW as CUDA runs it (foreach: a parameter-sized temporary)
    def step(_: PeakBytes) -> None:
        from ddp_lib.apps.smollm2 import random_smollm2

        model = random_smollm2("full")
        opt = torch.optim.AdamW(model.parameters(), lr=5e-5, foreach=True)
        ids = torch.randint(0, model.config.vocab_size, (pairs, seq))
        labels = torch.randint(0, 2, (pairs,))
        for _ in range(2):  # the optimizer state is allocated by the first step
            opt.zero_grad()
            model(input_ids=ids, labels=labels).loss.backward()
            opt.step()
    return step


def _mlp_fsdp_compare(width: int, depth: int, batch: int) -> Callable[[PeakBytes], None]:
    # lesson 08: the unsharded MLP DDP/ZeRO-1 compare against (SGD with momentum), at the timeline's batch
    def step(_: PeakBytes) -> None:
        from ddp_lib.kit.models import ToyModel

        model = ToyModel(width, width, width, depth=depth)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(batch, width)
        y = torch.randint(0, width, (batch,))
        for _ in range(2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return step


# per rank at the learner's -n 2; each lesson's largest step (the others are smaller and freed before it runs)
PLANS: dict[str, Callable[[PeakBytes], None]] = {
    "02": _lm_sgd("xl", 16, 256),  # cell 35: rank 0 alone on the whole global batch of 16 x 256 tokens
    "04": _lm_flat_sync("xl"),  # few_large: its gradients and FlatDDP's flat copy
    "05": _lm_race_bucketed("xl", 4, 128),  # the race's BucketedDDP variant, 8 sequences split over 2 ranks
    "06": _smollm2_adamw(16, 128),  # 16 pairs of 128 tokens per rank, fp32 (bf16 autocast keeps fp32 weights)
    "07": _lm_adamw_bucketed("xl", 2, 128),  # AdamW without sharding, the larger of the two variants
    "08": _mlp_fsdp_compare(4096, 8, 16384),  # the unsharded reference at the timeline's batch: above any FSDP step
}
