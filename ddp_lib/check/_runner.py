"""The checker framework: run named properties on every rank, agree on the verdict, print one table.

How to write a checker (e.g. in a new module `ddp_lib/check/<topic>.py`)::

    from ddp_lib.check._runner import Mismatch, Property, collectives, max_diff, run_check

    def check_double(fn, timeout_s=None):
        \"\"\"fn(t) returns 2 * t, the same on every rank.\"\"\"
        def doubles():
            t = torch.arange(4.0)
            return max_diff({"out": fn(t)}, {"out": 2 * t})   # raises Mismatch beyond 1e-5
        def silent():
            fn(torch.ones(3))
            if collectives():                                   # what this rank issued in this property
                raise Mismatch(f"issued {collectives()}")
        return run_check("double", [Property("doubles", doubles, "multiply, do not add"),
                                    Property("no communication", silent, "nothing to reduce here")],
                         timeout_s)

`Property(..., needs=("doubles",))` runs only once "doubles" has passed, and otherwise reads "not checked: needs
doubles first", so that one mistake gets one diagnosis instead of a hint per property it breaks.

Each property is a function with no argument, run on every rank; it returns the largest difference it
measured (or None) and fails by raising (`Mismatch` for a wrong value, anything the learner's code raises
for the rest). The framework does the rest: `NotImplementedError` reads "not written yet", any other
exception is a one-line failure on the rank that raised it, collectives are compared across ranks before
they run (see `_guard`), the outcomes are exchanged through the store so `.passed`/`.failed` are identical
on every rank, and rank 0 prints the table. A property must not communicate outside the learner's code
(compare with a reference each rank computes itself) and should take well under a second on 2 CPU ranks.
`Property(..., p2p=True)` also guards the learner's send/recv/isend/irecv (see `_p2p`), e.g. for a ring.
Keep each checker's properties in a module of its own and test it on 2 gloo ranks (`ddp_lib.launch.spawn`):
a right answer passes, a stub reads "not written yet", each planted mistake fails the property named for it.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ddp_lib.check._deadline import DeadlinePassed, ShieldedGuard, TimedOut, time_limit
from ddp_lib.check._collective_guard import CollectiveMismatch, Guard
from ddp_lib.devices import require_process_group

DEFAULT_TIMEOUT_S = 60.0  # a check ends within this, whatever the learner wrote
STUCK = "did not return within"  # how a property the deadline interrupted reads
DESYNC_HINT = "every rank must issue the same collectives, in the same order, with the same shapes"
TOL = 1e-5
_COLOURS = {"PASS": "green", "not checked": "grey"}  # anything else is crimson
_active: list[Guard] = []
_counters: dict[str, itertools.count] = {}


class Mismatch(AssertionError):
    """A property's value is wrong: `diff` is the largest difference found (None when not a number)."""

    def __init__(self, message: str, diff: float | None = None):
        super().__init__(message)
        self.diff = diff


class Refusal(Exception):
    """Raise it from a property where refusing is right if, and only if, every rank refuses."""


@dataclass
class Property:
    """A named property: `run()` returns the largest difference (or None) or raises; `hint`: the usual mistake."""

    name: str
    run: Callable[[], float | None]
    hint: str = ""
    p2p: bool = False  # route send/recv to a side group with the check's timeout (see _p2p)
    needs: tuple[str, ...] = ()  # properties that must pass first; else this one reads "not checked" (one diagnosis)
    ranks: int = 1  # the fewest ranks it can be checked on (a mismatch between ranks needs two); fewer: "not checked"


@dataclass
class Row:
    """One property's verdict, the same on every rank."""

    name: str
    status: str  # "PASS", "FAIL", "not written yet" or "not checked" (a property it needs did not pass)
    ranks: list[int] = field(default_factory=list)
    diff: float | None = None
    detail: str = ""
    hint: str = ""
    short_of_ranks: int = 0  # "not checked" because it needs this many ranks and the group has fewer (0: not so)


@dataclass
class CheckResult:
    """The outcome of a checker: `.passed` and `.failed` are identical on every rank."""

    title: str
    rows: list[Row]

    @property
    def passed(self) -> bool:
        """True when every property passed."""
        return all(r.status == "PASS" for r in self.rows)

    @property
    def failed(self) -> list[str]:
        """Names of the properties that did not pass (failed, not written yet, or not checked)."""
        return [r.name for r in self.rows if r.status != "PASS"]

    def headline(self) -> str:
        """The table's first line: what passed, what did not, and what this group is too small to check."""
        if self.passed:
            return f"{self.title}: all properties pass"
        short = [r for r in self.rows if r.short_of_ranks]
        wrong = [r.name for r in self.rows if r.status != "PASS" and not r.short_of_ranks]
        said = f"{', '.join(wrong)} not passing" if wrong else "every property checked passes"
        if short:
            n = max(r.short_of_ranks for r in short)
            said += (f"; {', '.join(r.name for r in short)} not checked: {'it needs' if len(short) == 1 else 'they need'}"
                     f" {n} ranks (start them with -n {n})")
        return f"{self.title}: {said}"

    def table(self) -> str:
        """The plain-text table rank 0 prints."""
        head = ("property", "result", "failing ranks", "largest diff", "what happened / the usual mistake")
        body = [(r.name, r.status, ",".join(map(str, r.ranks)) or "-",
                 "-" if r.diff is None else f"{r.diff:.1e}",
                 " | hint: ".join(x for x in (r.detail, "" if r.status == "PASS" else r.hint) if x))
                for r in self.rows]
        widths = [max(len(x[i]) for x in [head] + body) for i in range(4)]
        lines = [self.headline()]
        for row in [head] + body:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
        return "\n".join(line.rstrip() for line in lines)

    def __repr__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        import html

        cells = "".join(
            f"<tr><td>{html.escape(r.name)}</td><td style='color:{_COLOURS.get(r.status, 'crimson')}'>"
            f"{r.status}</td><td>{','.join(map(str, r.ranks)) or '-'}</td>"
            f"<td>{'-' if r.diff is None else f'{r.diff:.1e}'}</td>"
            f"<td>{html.escape(r.detail)}{'<br><i>hint: ' + html.escape(r.hint) + '</i>' if r.status != 'PASS' and r.hint else ''}</td></tr>"
            for r in self.rows)
        return (f"<b>{html.escape(self.headline())}</b><table><tr><th>property</th><th>result</th><th>failing ranks</th>"
                f"<th>largest diff</th><th>what happened</th></tr>{cells}</table>")


def collectives() -> list[str]:
    """The collectives this rank has issued so far in the running property, in order (names)."""
    return list(_active[-1].calls) if _active else []


def blocking() -> list[bool]:
    """Per collective of `collectives()`: True where it was issued without `async_op=True` (it blocked)."""
    return list(_active[-1].blocking) if _active else []


def waits() -> int:
    """How many times this rank has called `Work.wait()` so far in the running property."""
    return _active[-1].waits if _active else 0


def collective_groups() -> list[tuple[str, tuple[int, ...]]]:
    """Like `collectives()`, each with the global ranks of the group it ran in."""
    return list(zip(_active[-1].calls, _active[-1].groups)) if _active else []


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float = TOL,
             what: str = "") -> float:
    """Largest |got - want| over matching entries; raises Mismatch naming the worst entry beyond `tol`."""
    worst, where = 0.0, ""
    for k, w in want.items():
        g = got.get(k)
        if g is None:
            raise Mismatch(f"{what}{k}: missing (None)")
        if g.shape != w.shape:
            raise Mismatch(f"{what}{k}: shape {list(g.shape)}, expected {list(w.shape)}")
        d = (g.detach().double().cpu() - w.detach().double().cpu()).abs().max().item() if w.numel() else 0.0
        if d != d or d > worst:  # NaN counts as the worst
            worst, where = (float("inf") if d != d else d), k
    if worst > tol:
        raise Mismatch(f"{what}{where} differs by {worst:.1e}", worst)
    return worst


def _timeout(timeout_s: float | None) -> float:
    return float(timeout_s if timeout_s is not None else os.environ.get("DDP_CHECK_TIMEOUT", DEFAULT_TIMEOUT_S))


def _outcome(prop: Property, budget_s: float) -> dict[str, Any]:
    start = time.monotonic()
    try:
        with time_limit(budget_s, "the code under check"):
            diff = prop.run()
        return {"status": "PASS", "diff": diff}
    except (TimedOut, DeadlinePassed):
        return _stuck(budget_s)
    except dist.DistStoreError as e:
        # the store's timeout, which run_check set to this budget, can fire before the deadline's interrupt on a
        # loaded machine: the same wait with no deadline (a learner's own timeout under 0.9 of it reads as itself)
        return _stuck(budget_s) if time.monotonic() - start >= 0.9 * budget_s else _error(e)
    except NotImplementedError as e:
        return {"status": "not written yet", "detail": str(e) or "NotImplementedError"}
    except Mismatch as e:
        return {"status": "FAIL", "diff": e.diff, "detail": str(e)}
    except Refusal as e:
        return {"status": "REFUSED", "detail": str(e)}
    except CollectiveMismatch as e:
        return {"status": "FAIL", "detail": str(e), "secondary": e.secondary, "desync": True}
    except Exception as e:  # noqa: BLE001 - the learner's mistake is a failed property, never a traceback
        return _error(e)


def _stuck(budget_s: float) -> dict[str, Any]:
    return {"status": "FAIL", "stuck": True, "detail": f"the code under check {STUCK} {budget_s:.3g} s: an "
            "endless loop, or a wait with no deadline (store.get / store.wait without a timeout)?"}


def _error(e: BaseException) -> dict[str, Any]:
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return {"status": "FAIL", "detail": f"{type(e).__name__}: {first}"}


def _merge(prop: Property, outs: dict[int, dict | None], timeout_s: float) -> Row:
    outs = {r: o if o is not None else {"status": "FAIL", "detail": f"no answer within {timeout_s:g} s "
                                        "(is the check cell running on every rank?)"} for r, o in outs.items()}
    refused = sorted(r for r, o in outs.items() if o["status"] == "REFUSED")
    if refused and len(refused) == len(outs):
        return Row(prop.name, "PASS", [], None, f"refused on every rank: {outs[refused[0]]['detail']}")
    for r, o in list(outs.items()):  # refusing alone leaves the other ranks waiting in their next collective
        if refused and r not in refused and o["status"] == "PASS":
            outs[r] = {"status": "FAIL", "detail": f"went on while rank(s) {','.join(map(str, refused))} refused: "
                       "every rank must refuse"}
    for r in refused:
        outs[r] = {"status": "PASS"}
    diffs = [o["diff"] for o in outs.values() if o.get("diff") is not None]
    diff = max(diffs) if diffs else None
    bad = {r: o for r, o in outs.items() if o["status"] != "PASS"}
    if not bad:
        return Row(prop.name, "PASS", [], diff)
    if all(o["status"] == "not written yet" for o in bad.values()) and len(bad) == len(outs):
        return Row(prop.name, "not written yet", [], None, "raises NotImplementedError", "")
    primary = {r: o for r, o in bad.items() if not o.get("secondary")} or bad
    details = {}
    for r, o in sorted(primary.items()):
        details.setdefault(o.get("detail", ""), []).append(r)
    detail = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}: {d}"
                       for d, rs in details.items())
    hint = DESYNC_HINT if all(o.get("desync") for o in primary.values()) else prop.hint
    return Row(prop.name, "FAIL", sorted(primary), diff, detail, hint)


@functools.cache
def _warm_up() -> None:
    """Once per process, outside any deadline: the first optimizer imports torch._dynamo (seconds on a busy CPU)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def run_check(title: str, properties: list[Property], timeout_s: float | None = None,
              namespaces: list[dict] = (), quiet: bool = False, warm_up: bool = True) -> CheckResult:
    """Run each property on every rank of the default group; rank 0 prints the table; return the result.

    `namespaces`: extra global dicts (e.g. the learner function's `__globals__`) whose aliases of the
    collectives are guarded too. `timeout_s` (default 60, env DDP_CHECK_TIMEOUT) bounds the whole check, whatever
    the learner wrote: past it, the property running reads "did not return within N s" and the rest "not checked".
    `warm_up=False`: a check whose properties never build an optimizer skips importing torch._dynamo.
    """
    require_process_group()
    if warm_up:
        _warm_up()
    timeout = _timeout(timeout_s)
    margin = min(5.0, 0.2 * timeout)  # kept for interrupting the code and exchanging the verdicts
    deadline = time.monotonic() + timeout - margin
    rank, ws = dist.get_rank(), dist.get_world_size()
    base = c10d._get_default_store()
    run_id = next(_counters.setdefault(title, itertools.count()))
    rows: list[Row] = []
    stuck = ""
    store_timeout = base.timeout
    try:
        for i, prop in enumerate(properties):
            skipped = _skipped_row(prop, rows, stuck, ws)
            if skipped is not None:
                rows.append(skipped)
                continue
            budget = max(deadline - time.monotonic(), 1.0)
            base.set_timeout(timedelta(seconds=budget))  # a learner's store.get/wait on it gives up in time
            store = dist.PrefixStore(f"ddp_check/{title}/{run_id}/{i}/", base)
            outs = _run_guarded(prop, ShieldedGuard(store, rank, ws, budget, namespaces), budget, margin)
            rows.append(_merge(prop, outs, timeout))
            if any(o is None or o.get("stuck") for o in outs.values()):
                stuck = prop.name
    finally:
        base.set_timeout(store_timeout)
    result = CheckResult(title, rows)
    if rank == 0 and not quiet:
        print(result.table(), flush=True)
    return result


def _skipped_row(prop: Property, rows: list[Row], stuck: str, ws: int) -> Row | None:
    """The "not checked" row of a property that waits for one that did not pass, follows a stuck one, or needs more
    ranks; None when it runs. The rows are identical on every rank: every rank skips it together."""
    waiting = [r.name for r in rows if r.name in prop.needs and r.status != "PASS"]
    if not (waiting or stuck or ws < prop.ranks):
        return None
    why = (f"{stuck} {STUCK} its time: not run" if stuck else f"needs {' and '.join(waiting)} first"
           if waiting else f"needs {prop.ranks} ranks, this group has {ws}: start them with -n {prop.ranks}")
    # short of ranks: this property needs more, or every property it waits for does
    shorts = [r.short_of_ranks for r in rows if r.name in waiting]
    short = 0 if stuck else prop.ranks if ws < prop.ranks else min(shorts) and max(shorts)
    return Row(prop.name, "not checked", [], None, why, short_of_ranks=short)


def _run_guarded(prop: Property, guard: ShieldedGuard, budget: float, margin: float) -> dict:
    """Run `prop` on this rank under `guard`; return every rank's outcome (None for a rank that never answered)."""
    if prop.p2p:
        from ddp_lib.check._p2p import P2P

        guard.p2p = P2P(guard)
    with guard:
        _active.append(guard)
        try:
            out = _outcome(prop, budget)
        finally:
            _active.pop()
    guard.post_done(out)
    guard.timeout_s = budget + margin  # a peer interrupted at its own deadline still answers
    outs = guard.gather_done()
    if guard.p2p is not None:
        guard.p2p.close()
    return outs


def learner_namespaces(*fns: Any) -> list[dict]:
    """The global namespaces of the learner's functions/classes (where `from torch.distributed import ...` lands)."""
    spaces = []
    for f in fns:
        g = getattr(f, "__globals__", None)
        if g is None and isinstance(f, type):
            g = next((m.__globals__ for m in vars(f).values() if hasattr(m, "__globals__")), None)
        if g is not None:
            spaces.append(g)
    return spaces
