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


def warm_up() -> None:
    """Pay torch's one-time imports (an optimizer's first construction imports dynamo: seconds on a busy CPU)
    on every rank before any check, so that no rank arrives at a collective seconds after its peer."""
    import torch
    import torch.distributed as dist

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    dist.barrier()


def run_case(checker, *answers, timeout_s: float) -> dict:
    """One check of the learner's `answers`, as the tests keep it: passed, failed, each row (status, detail,
    hint), the table and the seconds it took."""
    import time

    t0 = time.monotonic()
    res = checker(*answers, timeout_s=timeout_s)
    return {"passed": res.passed, "failed": res.failed, "table": res.table(), "seconds": time.monotonic() - t0,
            "rows": {r.name: (r.status, r.detail, r.hint) for r in res.rows}}


def group_intact(out: dict) -> dict:
    """`out` with "group": one all-reduce on the default group, which must have survived every case before it."""
    import torch
    import torch.distributed as dist

    t = torch.ones(2)
    dist.all_reduce(t)
    out["group"] = t.tolist()
    return out


def run_suites(suites: dict, checkers: dict, limit_s: float, only: list[str] | None = None) -> dict:
    """On each rank: every case of `suites` (or of those named in `only`) through its checker, in order; then one
    all-reduce on the default group (it must have survived every planted mistake)."""
    warm_up()
    out = {}
    for suite, cases in suites.items():
        if only is not None and suite not in only:
            continue
        for name, (checker, make) in cases.items():
            out[suite, name] = run_case(checkers[checker], make(), timeout_s=limit_s)
    return group_intact(out)


def assert_same_verdict(results: list[dict]) -> None:
    """Both ranks reached the same verdict on every case, and the default group still works."""
    r0, r1 = results
    for key in r0:
        if isinstance(key, tuple):  # a (suite, case); other keys hold what a module adds (the group, a stub)
            assert r0[key]["failed"] == r1[key]["failed"], (key, r0[key]["table"], r1[key]["table"])
    assert r0["group"] == r1["group"] == [2.0, 2.0]


def suite_tests(suites: dict, mistakes: list) -> tuple:
    """The four tests every mutation suite runs on its module's `results` fixture (both ranks' `run_suites`):
    the same verdict on both ranks, each right answer passes, each planted mistake fails its property with one
    diagnosis, and every suite is big enough."""
    import pytest

    right = [(s, n) for s, cases in suites.items() for n in cases if n.startswith("right: ")]

    def test_same_verdict_on_every_rank_and_group_intact(results):
        assert_same_verdict(results)

    @pytest.mark.parametrize("suite, name", right, ids=[f"{s}-{n}" for s, n in right])
    def test_right_answers_written_another_way_pass(results, suite, name):
        res = results[0][suite, name]
        assert res["failed"] == [], res["table"]

    @pytest.mark.parametrize("suite, name, prop, words", mistakes, ids=[f"{s}-{n}" for s, n, _, _ in mistakes])
    def test_planted_mistake_fails_its_property_with_one_diagnosis(results, suite, name, prop, words):
        assert_one_diagnosis(results[0][suite, name], prop, words)

    def test_suites_are_big_enough():
        assert_suites_big_enough(suites, mistakes)

    return (test_same_verdict_on_every_rank_and_group_intact, test_right_answers_written_another_way_pass,
            test_planted_mistake_fails_its_property_with_one_diagnosis, test_suites_are_big_enough)
