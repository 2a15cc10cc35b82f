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
