"""`make gpu-check`'s memory probe: the peak GPU memory of every cell of a lesson, read on every rank.

A lesson resets the allocator's peak itself (`torch.cuda.reset_peak_memory_stats` before a measurement), which
erases whatever an earlier cell reached, so one reading before `%dist_shutdown` misses peaks. `install()` (run on
the ranks after each `%dist_init`) wraps the reset: it keeps the peak it is about to erase, and `peak()` keeps
answering what the lesson expects (the peak since *its* last reset). `cell_peak()` (run after every lesson cell)
reports the cell's own peak, the largest over the stretches between resets inside the cell, then starts the next
cell's count. `prepare_lesson` inserts both cells into a lesson copy; `read_probes` parses what the ranks printed.
"""

from __future__ import annotations

import json
import re

import torch

PROBE_MARK = "GPU_CHECK_MEM"
KINDS = ("allocated", "reserved")


class _Peaks:
    """Per kind: the peaks erased inside the current cell, and the lesson's view since its own last reset."""

    def __init__(self) -> None:
        self.in_cell: dict[str, list[int]] = {k: [] for k in KINDS}
        self.since_lesson_reset: dict[str, int] = {k: 0 for k in KINDS}


_STATE: _Peaks | None = None
_REAL: dict = {}


def _read(kind: str, device=None) -> int:
    return _REAL[kind](device)


def install() -> None:
    """Wrap torch.cuda's peak reset and readings on this rank (idempotent; a no-op without CUDA)."""
    global _STATE
    if _STATE is not None or not torch.cuda.is_available():
        return
    _STATE = _Peaks()
    _REAL.update(reset=torch.cuda.reset_peak_memory_stats, allocated=torch.cuda.max_memory_allocated,
                 reserved=torch.cuda.max_memory_reserved)

    def reset_peak_memory_stats(device=None) -> None:
        for kind in KINDS:  # the lesson's reset: keep the cell's peak so far, forget the lesson's view
            _STATE.in_cell[kind].append(_read(kind, device))
            _STATE.since_lesson_reset[kind] = 0
        _REAL["reset"](device)

    def reading(kind: str):
        def max_memory(device=None) -> int:
            return max(_read(kind, device), _STATE.since_lesson_reset[kind])
        max_memory.__name__ = f"max_memory_{kind}"
        return max_memory

    for module in (torch.cuda, torch.cuda.memory):
        module.reset_peak_memory_stats = reset_peak_memory_stats
        module.max_memory_allocated = reading("allocated")
        module.max_memory_reserved = reading("reserved")


def cell_peak(cell: int, rank: int, device: torch.device) -> str:
    """One probe line: this cell's peak MiB on this rank (None on CPU ranks); then the next cell's count starts."""
    row: dict = dict(cell=cell, rank=rank, device=str(device))
    for kind in KINDS:
        if _STATE is None or device.type != "cuda":
            row[f"peak_{kind}_mb"] = None
            continue
        now = _read(kind, device)
        row[f"peak_{kind}_mb"] = max(_STATE.in_cell[kind] + [now]) / 2**20
        # the lesson's view keeps this cell's stretch since its last reset; the real counter starts afresh
        _STATE.since_lesson_reset[kind] = max(_STATE.since_lesson_reset[kind], now)
        _STATE.in_cell[kind].clear()
    if _STATE is not None and device.type == "cuda":
        _REAL["reset"](device)
    return f"{PROBE_MARK} {json.dumps(row)}"


INSTALL_CELL = "%%distributed\nfrom ddp_lib.course import gpu_probe as _gpu_probe\n_gpu_probe.install()"


def probe_cell(index: int) -> str:
    """The cell that reports lesson cell `index`'s peak on every rank."""
    return f"%%distributed\nprint(_gpu_probe.cell_peak({index}, rank, device))"


def prepare_lesson(nb, ranks: int) -> int:
    """Edit a lesson copy in place: its 2-rank `%dist_init` gets `-n <ranks>`, the probe is installed after every
    `%dist_init`, and every lesson cell run on the ranks is followed by its probe. Returns the probes inserted."""
    import nbformat

    cells, probes, live = [], 0, False
    for index, cell in enumerate(nb.cells):
        code = cell.cell_type == "code"
        if code and cell.source.lstrip().startswith("%dist_shutdown"):
            live = False
        if code and "dist_init" in cell.source:
            cell.source = re.sub(r"(dist_init\b[^\n]*?)-n 2\b", rf"\1-n {ranks}", cell.source)
        cells.append(cell)
        if code and "dist_init" in cell.source:
            cells.append(nbformat.v4.new_code_cell(INSTALL_CELL))
            live = True
        elif code and live:
            cells.append(nbformat.v4.new_code_cell(probe_cell(index)))
            probes += 1
    nb.cells = cells
    return probes


def read_probes(nb) -> list[dict]:
    """The probe lines the ranks printed, from an executed lesson copy."""
    found = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            for m in re.finditer(rf"{PROBE_MARK} (\{{.*?\}})", out.get("text", "")):
                found.append(json.loads(m.group(1)))
    return found
