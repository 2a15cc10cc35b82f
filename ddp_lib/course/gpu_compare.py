"""What `make gpu-check` compares a real box against: memory peaks against the card and the plan,
all-reduce busbw against the link class, and the transport NCCL chose. Pure functions over text and numbers, so
they are tested with fake inputs (tests/test_gpu_compare.py) on machines without a GPU.

- The dry plan: `python -m ddp_lib.gpusim.run --profile <the box's card> --dry` first (real sizes, no data,
  memory counted), its per-GPU peaks against the real reserved peaks (docs/gpu-simulation.md's margin).
- The plan: `ddp_lib.course.gpu_needs.NEED_GIB`, the peak GiB of tensors one rank holds in each lesson's largest
  step at its real sizes (-n 2), planned on the meta device. A lesson's measured peak *allocated* memory is
  compared with it; its peak *reserved* memory (the caching allocator's, which the CUDA context and NCCL's
  buffers do not even include) with the card.
- The link class: `nvidia-smi topo -m` names NVLink between two GPUs `NV<k>`; PIX, PXB, PHB, NODE and SYS are PCIe
  paths (through switches, host bridges, or across CPU sockets).
- The transport: with `NCCL_DEBUG=INFO` NCCL logs each channel it opens, e.g.
  `Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read`, `via SHM/direct/direct`, `via NET/IB/0`, `via NET/Socket/0`.
  P2P is GPU to GPU (over NVLink or PCIe), SHM through host memory, NET over the network stack.
"""

from __future__ import annotations

import re

# Rough bounds, not targets: an 8-GPU NVLink box (H100 NV18) reaches hundreds of GB/s of all-reduce busbw in
# nccl-tests, a PCIe 4.0 x16 link carries at most 32 GB/s per direction and 5.0 x16 64 GB/s. A busbw under the
# NVLink floor means the collective did not run at NVLink speed (look at the transport); one above the PCIe ceiling
# on a box whose topology shows no NVLink means the topology was misread.
NVLINK_FLOOR_GBPS = 50.0
PCIE_CEILING_GBPS = 64.0

_PCIE = ("PIX", "PXB", "PHB", "NODE", "SYS")
_VIA = re.compile(r"\bvia\s+((?:P2P|SHM|NET|COLLNET)(?:/[A-Za-z0-9_]+)*)")


def link_class(topology: str) -> str:
    """'NVLink', 'PCIe' or 'unknown' from `nvidia-smi topo -m`'s matrix (its legend lines are skipped)."""
    matrix = [line for line in topology.splitlines() if re.match(r"\s*GPU\d+\s", line)]
    cells = " ".join(matrix).split()
    if any(re.fullmatch(r"NV\d+", c) for c in cells):
        return "NVLink"
    if any(c in _PCIE for c in cells):
        return "PCIe"
    return "unknown"


def nccl_transports(log: str) -> list[str]:
    """The transports NCCL opened channels over, from an `NCCL_DEBUG=INFO` log, sorted and without repeats
    (a trailing device index is dropped: `NET/IB/0` -> `NET/IB`)."""
    found = {re.sub(r"/\d+$", "", m) for m in _VIA.findall(log)}
    return sorted(found)


def transport_kind(transports: list[str]) -> str:
    """One phrase for what the transports mean (GPU to GPU, host memory, network), or that none was logged."""
    if not transports:
        return "no transport logged (NCCL_DEBUG=INFO not set, or one rank)"
    kinds = {"P2P": "GPU to GPU (P2P: NVLink or PCIe)", "SHM": "through host memory (SHM)",
             "NET": "over the network stack (NET)", "COLLNET": "over the network (CollNet)"}
    return ", ".join(dict.fromkeys(kinds[t.split("/")[0]] for t in transports))


def busbw_verdict(busbw_GBps: float | None, link: str) -> str:
    """The largest measured all-reduce busbw judged against the link class (rough bounds, see the constants)."""
    if busbw_GBps is None:
        return "not measured"
    if link == "NVLink" and busbw_GBps < NVLINK_FLOOR_GBPS:
        return (f"LOW: {busbw_GBps:.1f} GB/s on an NVLink box, under {NVLINK_FLOOR_GBPS:g} GB/s: the all-reduce did "
                "not run at NVLink speed (see the transport)")
    if link == "PCIe" and busbw_GBps > PCIE_CEILING_GBPS:
        return (f"ODD: {busbw_GBps:.1f} GB/s is above what a PCIe 5.0 x16 link carries ({PCIE_CEILING_GBPS:g} GB/s): "
                "the topology was misread")
    return f"ok: {busbw_GBps:.1f} GB/s for {link}"


def profile_for(gpus: list[dict]) -> str | None:
    """The simulated box (`ddp_lib.gpusim` profile) whose card matches this box's, for the dry plan; None: none does.
    Several H100s: 8xH100 (at -n 2 it uses two of them, so its per-GPU peaks are those of any H100 box)."""
    name, count = gpus[0]["name"], len(gpus)
    if "H100" in name:
        return "8xH100" if count > 1 else "1xH100"
    for card, profile in (("T4", "2xT4"), ("L4", "1xL4"), ("A100", "2xA100")):
        if re.search(rf"\b{card}\b", name):
            return profile
    return None


def dry_peaks(peaks: dict) -> dict[str, float]:
    """Per lesson number, the dry run's largest per-GPU peak (GiB) from `ddp_lib.gpusim.run --dry`'s peaks.json."""
    out = {}
    for stem, rec in peaks.get("lessons", {}).items():
        per_gpu = rec.get("gpu_peak_gib") or {}
        if per_gpu:
            out[stem[:2]] = max(per_gpu.values())
    return out


# a real box's reserved peak is roughly the dry peak x 1.05-1.2 plus 0.5-1.5 GiB (CUDA context, NCCL's buffers, the
# caching allocator's rounding: docs/gpu-simulation.md); above the top of that range the dry plan missed something
DRY_MARGIN = (1.2, 1.5)


def memory_rows(lessons: list[dict], card_gib: float, plan_gib: dict[str, float] | None = None,
                dry_gib: dict[str, float] | None = None) -> list[dict]:
    """Per lesson run ({'name', 'peak_allocated_mb', 'peak_reserved_mb'}; the name starts with the lesson number):
    its peaks in GiB, the plan, the dry run's peak, and a verdict: 'over the card' (reserved > card), 'over the dry
    plan's margin' (reserved > dry x 1.2 + 1.5 GiB), 'over the plan' (allocated > planned), 'within the plan',
    'no plan' (lessons not planned), or 'not measured' (no probe read a peak)."""
    if plan_gib is None:
        from ddp_lib.course.gpu_needs import NEED_GIB as plan_gib
    dry_gib = dry_gib or {}
    rows = []
    for s in lessons:
        number = s["name"][:2]
        alloc, reserved = s.get("peak_allocated_mb"), s.get("peak_reserved_mb")
        planned, dry = plan_gib.get(number), dry_gib.get(number)
        row = dict(name=s["name"], planned_gib=planned, card_gib=card_gib, dry_gib=dry,
                   allocated_gib=None if alloc is None else alloc / 1024,
                   reserved_gib=None if reserved is None else reserved / 1024)
        if alloc is None and reserved is None:
            row["verdict"] = "not measured"
        elif reserved is not None and row["reserved_gib"] > card_gib:
            row["verdict"] = "over the card"
        elif reserved is not None and dry is not None and row["reserved_gib"] > dry * DRY_MARGIN[0] + DRY_MARGIN[1]:
            row["verdict"] = "over the dry plan's margin"
        elif planned is None and dry is not None:
            row["verdict"] = "within the dry plan"
        elif planned is None:
            row["verdict"] = "no plan"
        elif alloc is not None and row["allocated_gib"] > planned:
            row["verdict"] = "over the plan"
        else:
            row["verdict"] = "within the plan"
        rows.append(row)
    return rows


def max_busbw(rows: list[dict]) -> float | None:
    """The largest busbw among all-reduce benchmark rows with more than one rank (None: none)."""
    vals = [r["busbw_GBps"] for r in rows if r.get("world_size", 0) > 1 and r.get("busbw_GBps") is not None]
    return max(vals) if vals else None


def _gib(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def markdown(link: str, transports: list[str], busbw: float | None, memory: list[dict]) -> list[str]:
    """The report's section 'Against the plan and the link' as markdown lines."""
    lines = ["## Against the plan and the link", "",
             f"- link class (`nvidia-smi topo -m`): {link}",
             f"- transport NCCL chose (`NCCL_DEBUG=INFO`, the all-reduce benchmark): "
             f"{', '.join(transports) or '–'}: {transport_kind(transports)}",
             f"- all-reduce busbw, best over the sizes: {busbw_verdict(busbw, link)}", ""]
    if memory:
        lines += ["Peak allocated memory against the plan (`gpu_needs.NEED_GIB`, tensors only) and peak reserved "
                  "against the card (a real box's reserved peak is roughly the plan x 1.05-1.2 plus 0.5-1.5 GiB):", "",
                  "| lesson | allocated GiB | planned GiB | reserved GiB | dry peak GiB | card GiB | verdict |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['name']} | {_gib(r['allocated_gib'])} | {_gib(r['planned_gib'])} | "
                  f"{_gib(r['reserved_gib'])} | {_gib(r.get('dry_gib'))} | {r['card_gib']:.1f} | {r['verdict']} |"
                  for r in memory]
    return lines
