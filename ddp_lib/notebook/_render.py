"""Showing what the ranks produced: live while a cell runs, then once more, faithfully and in rank order."""

from __future__ import annotations

import os
import sys
from typing import Any

LIVE_AFTER_S = 0.5  # cells quicker than this show only their final, rank-ordered output
ENV_LIVE_AFTER = "DDP_NB_LIVE_AFTER_S"


def live_after_s() -> float:
    """Seconds before a cell's output streams live; `inf` turns the live view off.

    The live view is replaced by the rank-ordered output through clear_output(wait=True).
    Clients that ignore clear_output (nbval 0.11 does) would see both, so the test
    configuration sets DDP_NB_LIVE_AFTER_S=inf.
    """
    value = os.environ.get(ENV_LIVE_AFTER, "")
    try:
        return float(value) if value else LIVE_AFTER_S
    except ValueError:
        raise ValueError(f"{ENV_LIVE_AFTER}={value!r}: expected seconds (a number, or inf)") from None


class RankError(Exception):
    """One or more ranks failed (error, timeout, death); their tracebacks are shown above, in rank order."""

    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = dict(sorted(failures.items()))
        lines = [f"rank {r}: {msg}" for r, msg in self.failures.items()]
        super().__init__(f"{len(self.failures)} rank(s) failed: " + "; ".join(lines))

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of the magic's own (irrelevant) stack."""
        return [f"RankError: {len(self.failures)} rank(s) failed (tracebacks above, in rank order)"] + [
            f"  rank {r}: {msg}" for r, msg in self.failures.items()
        ]


class CellInterrupted(KeyboardInterrupt):
    """The cell was stopped from the notebook; the ranks were interrupted and (unless said) kept."""

    def _render_traceback_(self) -> list[str]:
        return ["KeyboardInterrupt: the cell was interrupted on the ranks (their tracebacks are above)"]


class MimeBundle:
    """A rank's cell result, shown by Jupyter as the cell's own Out[n]."""

    def __init__(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        self.data, self.metadata = data, metadata

    def _repr_mimebundle_(self, include=None, exclude=None):  # noqa: ARG002
        return self.data, self.metadata

    def __repr__(self) -> str:
        return self.data.get("text/plain", "")


def squash_cr(text: str) -> str:
    """What a terminal would finally show for each line: a tqdm bar's last state, not every redraw.

    A rewritten line keeps no trailing blanks, so a bar erased at the end (tqdm's `leave=False`
    writes `\r`, spaces, `\r`) leaves nothing, rather than an empty stderr box in the notebook.
    """
    if "\r" not in text:
        return text
    lines = text.replace("\r\n", "\n").split("\n")
    out = []
    for ln in lines:
        parts = ln.split("\r")
        while len(parts) > 1 and parts[-1] == "":
            parts.pop()
        out.append(parts[-1].rstrip(" ") if len(parts) > 1 else parts[-1])
    return "\n".join(out)


class Collector:
    """Everything the ranks of one cell produce, kept per rank in arrival order."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self.multi = len(ranks) > 1
        self.items: dict[int, list[list[Any]]] = {r: [] for r in ranks}
        self.results: dict[int, dict | None] = {}
        self.errors: dict[int, str] = {}  # traceback text per failed rank
        self.summaries: dict[int, str] = {}  # one line per failed rank, for the exception
        self.live = False
        self._line_start: dict[int, bool] = {r: True for r in ranks}
        self._last_stream: Any = None
        self._raw_item: dict[tuple[int, str], list[Any]] = {}  # (rank, stream) -> its raw fd output item

    def add(self, rank: int, kind: str, payload: Any, raw: bool = False) -> None:
        """Record output of `rank`. `raw` output (written to the fd below Python: C extensions,
        os.write) travels on another channel than Python-level writes, so the two have no common
        order; each rank's raw output of a stream is kept in one piece, where it started."""
        items = self.items.setdefault(rank, [])
        key = (rank, kind)
        if raw and key in self._raw_item:
            self._raw_item[key][1] += payload
        elif kind != "display" and items and items[-1][0] == kind and (items[-1] is self._raw_item.get(key)) == raw:
            items[-1][1] += payload
        else:
            items.append([kind, payload])
            if raw:
                self._raw_item[key] = items[-1]
        if self.live:
            self._show_live(rank, kind, payload)

    def start_live(self) -> None:
        """From now on write output as it arrives (what arrived so far first)."""
        self.live = True
        for r in self.ranks:
            for kind, payload in self.items.get(r, []):
                self._show_live(r, kind, payload)

    def _show_live(self, rank: int, kind: str, payload: Any) -> None:
        if kind == "display":
            return  # rich output waits for the final display
        stream = sys.stdout if kind == "stdout" else sys.stderr
        if self._last_stream is not None and self._last_stream is not stream:
            self._last_stream.flush()
        self._last_stream = stream
        if self.multi:
            prefix = f"[rank {rank}] "
            text = payload.replace("\r", "\r" + prefix)
            parts = text.split("\n")
            head = (prefix if self._line_start[rank] else "") + parts[0]
            text = "\n".join([head] + [prefix + p if p else p for p in parts[1:]])
            self._line_start[rank] = payload.endswith("\n")
            payload = text
        stream.write(payload)

    def render(self) -> MimeBundle | None:
        """The cell's final output: rank sections in rank order; a lone rank's result as Out[n]."""
        from IPython.display import clear_output, publish_display_data

        sys.stdout.flush()
        sys.stderr.flush()
        if self.live:
            clear_output(wait=True)  # replace the live, interleaved view with the ordered one
        ret = None
        for r in sorted(self.items.keys() | self.errors.keys() | {k for k, v in self.results.items() if v}):
            # streams as a terminal would finally show them; one that erased itself shows nothing
            items = [[k, p if k == "display" else squash_cr(p)] for k, p in self.items.get(r, [])]
            items = [it for it in items if it[0] == "display" or it[1]]
            if r in self.errors:
                items.append(["stderr", self.errors[r]])
            result = self.results.get(r)
            if not items and not result:
                continue
            if self.multi:
                self._write(sys.stdout, f"--- rank {r} ---\n")
            for kind, payload in items:
                if kind == "display":
                    self._flush()
                    publish_display_data(payload["data"], payload.get("metadata") or {})
                else:
                    if self.multi and not payload.endswith("\n"):
                        payload += "\n"  # the next rank's header starts on its own line
                    self._write(sys.stdout if kind == "stdout" else sys.stderr, payload)
            if result:
                if self.multi:
                    self._flush()
                    publish_display_data(result["data"], result.get("metadata") or {})
                else:
                    ret = MimeBundle(result["data"], result.get("metadata") or {})
        self._flush()
        return ret

    def _write(self, stream, text: str) -> None:
        if self._last_stream is not None and self._last_stream is not stream:
            self._last_stream.flush()
        self._last_stream = stream
        stream.write(text)

    def _flush(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self._last_stream = None
