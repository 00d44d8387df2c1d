"""CI's time budget for the slow tests (``--slow-budget-min``; `.ci/run`).

CI runs the default suite and the slow tests in one session and must end within the hour. On a
runner twice as slow as usual (2026-12-07: the default suite 36-39 minutes instead of 17-21,
CI's run cut at 90 minutes), the same tests would not fit. With a budget, every default test
runs; a slow test runs only if the time spent so far, the default tests still to come (at the
mean time a default test has taken in this session) and the test itself (the mean slow test, or
a third of its own timeout where it has a longer one) fit within it. Those
left out are skipped with the reason and named at the end: ``make test-slow`` runs them all.
Without the option nothing is skipped.
"""

from __future__ import annotations

import time

import pytest

#: a slow test's expected length before one has finished (CONTRIBUTING.md: 20-90 s each)
FIRST_SLOW_S = 60.0
#: a default test's expected length before one has finished
FIRST_DEFAULT_S = 1.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow-budget-min", type=float, default=None, metavar="MINUTES",
        help="run a slow test only where it and the default tests still to come fit within "
             "MINUTES of the session (CI); the others are skipped and named at the end")


def pytest_configure(config: pytest.Config) -> None:
    minutes = config.getoption("--slow-budget-min")
    if minutes is not None:
        if minutes <= 0:
            raise pytest.UsageError(f"--slow-budget-min must be positive, not {minutes}")
        config.pluginmanager.register(Budget(minutes), "ciuic-slow-budget")


def _slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


class Budget:
    """The session's clock and what its finished tests took, by kind (a plugin: its methods
    are pytest's hooks)."""

    def __init__(self, minutes: float) -> None:
        self.seconds = minutes * 60
        self.started = time.monotonic()
        self.defaults_after: dict[str, int] = {}  # nodeid -> default tests after it
        self.spent = {False: 0.0, True: 0.0}  # slow? -> seconds of the tests that ran
        self.done = {False: 0, True: 0}
        self.skipped: set[str] = set()  # their teardown is not a test's time
        self.left_out: list[str] = []

    def mean(self, slow: bool) -> float:
        if self.done[slow]:
            return self.spent[slow] / self.done[slow]
        return FIRST_SLOW_S if slow else FIRST_DEFAULT_S

    def pytest_sessionstart(self) -> None:
        self.started = time.monotonic()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        after = 0
        for item in reversed(session.items):
            self.defaults_after[item.nodeid] = after
            after += not _slow(item)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        if not _slow(item):
            return
        elapsed = time.monotonic() - self.started
        rest = self.defaults_after.get(item.nodeid, 0) * self.mean(False)
        # a test given a longer timeout than the suite's is known to be long: a third of it
        marker = item.get_closest_marker("timeout")
        own = float(marker.args[0]) / 3 if marker is not None and marker.args else 0.0
        need = max(self.mean(True), own)
        if elapsed + rest + need > self.seconds:
            self.left_out.append(item.nodeid)
            pytest.skip(
                f"CI's time budget ({self.seconds / 60:g} min): {elapsed / 60:.1f} min spent, "
                f"the default tests still to come need about {rest / 60:.1f} min and this "
                f"test {need / 60:.1f}; `make test-slow` runs it")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped:
            self.skipped.add(report.nodeid)
            return
        if report.nodeid in self.skipped:
            return
        slow = "slow" in report.keywords
        self.spent[slow] += report.duration
        if report.when == "teardown":
            self.done[slow] += 1

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.left_out:
            return
        terminalreporter.section("left out for CI's time budget", sep="=", yellow=True)
        terminalreporter.line(
            f"{len(self.left_out)} slow tests did not fit within {self.seconds / 60:g} minutes "
            "and were skipped; `make test-slow` runs every slow test:")
        for nodeid in self.left_out:
            terminalreporter.line(f"  {nodeid}")
