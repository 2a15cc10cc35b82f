"""What every checker's mutation suite asserts (tests/test_check_mutations_*.py)."""

from __future__ import annotations


def assert_one_diagnosis(res: dict, prop: str, words: str) -> None:
    """The planted mistake fails `prop`, its detail says `words`, and every other property passes or waits for it."""
    status, detail, _hint = res["rows"][prop]
    assert status == "FAIL" and words in detail, res["table"]
    others = {n: s for n, (s, _, _) in res["rows"].items() if n != prop}
    assert set(others.values()) <= {"PASS", "not checked"}, res["table"]


def assert_suites_big_enough(suites: dict, mistakes: list) -> None:
    """At least 5 planted mistakes and 2 right answers ("right: ...") per checker, every case in the list."""
    for suite, cases in suites.items():
        planted = [m for m in mistakes if m[0] == suite]
        assert len(planted) >= 5 and sum(n.startswith("right: ") for n in cases) >= 2, suite
        assert {m[1] for m in planted} == {n for n in cases if not n.startswith("right: ")}, suite


def run_suites(suites: dict, checkers: dict, limit_s: float, only: list[str] | None = None) -> dict:
    """On each rank: every case of `suites` (or of those named in `only`) through its checker, in order; then one
    all-reduce on the default group (it must have survived every planted mistake)."""
    import time

    import torch
    import torch.distributed as dist

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # one-time imports before any check
    dist.barrier()
    out = {}
    for suite, cases in suites.items():
        if only is not None and suite not in only:
            continue
        for name, (checker, make) in cases.items():
            t0 = time.monotonic()
            res = checkers[checker](make(), timeout_s=limit_s)
            out[suite, name] = {"failed": res.failed, "table": res.table(), "seconds": time.monotonic() - t0,
                                "rows": {r.name: (r.status, r.detail, r.hint) for r in res.rows}}
    t = torch.ones(2)
    dist.all_reduce(t)  # the group survived every mistake
    out["group"] = t.tolist()
    return out


def assert_same_verdict(results: list[dict]) -> None:
    """Both ranks reached the same verdict on every case, and the default group still works."""
    r0, r1 = results
    for key in r0:
        if key != "group":
            assert r0[key]["failed"] == r1[key]["failed"], (key, r0[key]["table"], r1[key]["table"])
    assert r0["group"] == r1["group"] == [2.0, 2.0]
