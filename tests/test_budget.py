"""CI's time budget for the slow tests (tests/budget.py), in a suite of its own (pytester)."""

from __future__ import annotations

import pytest

SUITE = """
import time
import pytest

def test_a_default_test():
    time.sleep(0.2)

@pytest.mark.slow
def test_a_slow_test():
    time.sleep(0.2)

def test_another_default_test():
    pass

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_slow_test_known_to_be_long():
    pass
"""

INI = """
[pytest]
markers =
    slow: slow
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeini(INI)
    pytester.makepyfile(test_suite=SUITE)
    return pytester.runpytest("-p", "tests.budget", "-rs", *args)


def test_without_a_budget_every_test_runs(pytester: pytest.Pytester) -> None:
    result = _run(pytester)
    result.assert_outcomes(passed=4)
    assert "left out for CI's time budget" not in result.stdout.str()


def test_a_slow_test_past_the_budget_is_skipped_and_named(pytester: pytest.Pytester) -> None:
    # 0.003 min = 0.18 s: the first default test (0.2 s) spends it, every default test runs
    result = _run(pytester, "--slow-budget-min", "0.003")
    result.assert_outcomes(passed=2, skipped=2)
    out = result.stdout.str()
    assert "CI's time budget (0.003 min)" in out
    assert "2 slow tests did not fit within 0.003 minutes" in out
    assert "test_suite.py::test_a_slow_test" in out.split("left out for CI's time budget")[1]


def test_a_slow_test_within_the_budget_runs(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "--slow-budget-min", "20")
    result.assert_outcomes(passed=4)


def test_a_slow_test_with_a_long_timeout_needs_a_third_of_it(pytester: pytest.Pytester) -> None:
    # 4 min: a slow test's mean (1 min) fits, a third of 900 s (5 min) does not
    result = _run(pytester, "--slow-budget-min", "4")
    result.assert_outcomes(passed=3, skipped=1)
    assert "test_suite.py::test_a_slow_test_known_to_be_long" in result.stdout.str().split(
        "left out for CI's time budget")[1]


def test_a_budget_that_is_not_positive_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "--slow-budget-min", "0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--slow-budget-min must be positive, not 0.0*"])
