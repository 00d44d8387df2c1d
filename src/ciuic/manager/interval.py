"""The interval that sets itself (``save_interval="auto"``): Young/Daly's optimum, measured.

A snapshot costs training time ``C``: the stall of ``step()`` while the state is copied, plus
the in-run slowdown while it is written in the background (steps taken while a write is in
flight run slower than the steps between writes; the difference, summed, is charged to the
snapshot). A job fails on average every ``M`` seconds. Snapshotting every ``T`` seconds then
wastes ``C / T`` of the time in overhead and, per failure, about ``T / 2`` of lost work: the sum
is smallest at Young's interval ``T = sqrt(2 C M)`` (Daly's refinement differs only when ``C``
nears ``M``).

``M`` comes from the job's own runs (the catalog records how each ended): ``n`` interruptions
(crashes, kills, signals) over ``t`` seconds of observed training, with a prior worth one
failure per ``prior_mtbf_s``: ``M = (t + prior_mtbf_s) / (n + 1)``. A job that never failed
starts at the prior and moves away from it as evidence accrues.

Two bounds apply, in this order: the interval is at least ``C / max_overhead`` (snapshots never
cost more than that share of training), and at most ``max_interval_s`` (never more than that
much work to lose), which wins when the two conflict. The first snapshot is taken at the
first ``step()`` (``first_snapshot_s=0``, the default): it is the measurement of ``C``, and a
crash in the job's first minutes then loses only what came after it (an interval that waited
to measure would leave nothing to resume from). The second replaces its cost (the first paid
once for staging buffers and for writing every chunk), and each later one updates it (an
exponential average that gives the newest half the weight, so that a store that slows down
shows at once).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ciuic.errors import ConfigurationError
from ciuic.words import counted

log = logging.getLogger("ciuic")
#: an interval change is logged when it moves by more than this share
_LOG_CHANGE = 0.2
_EMA = 0.5  # weight of the newest snapshot's cost: a slower store shows at the next snapshot


@dataclass(frozen=True)
class AutoInterval:
    """``save_interval=AutoInterval(...)``: ``"auto"`` with other bounds or another prior.

    Args:
        max_overhead: the largest share of training time snapshots may cost.
        max_interval_s: the longest time between two snapshots.
        prior_mtbf_s: the mean time between failures assumed before the job has shown its own.
        first_snapshot_s: seconds after the start (or the restore) when the first snapshot
            is taken, to measure its cost; 0: at the first ``step()``.
    """

    max_overhead: float = 0.01
    max_interval_s: float = 3600.0
    prior_mtbf_s: float = 24 * 3600.0
    first_snapshot_s: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.max_overhead, (int, float)) and 0 < self.max_overhead < 1):
            raise ConfigurationError(f"max_overhead is a share of training time between 0 and "
                                     f"1 (0.01 = 1 %), got {self.max_overhead!r}")
        for name in ("max_interval_s", "prior_mtbf_s", "first_snapshot_s"):
            v = getattr(self, name)
            least = 0 if name == "first_snapshot_s" else 1e-9  # the first may be at once
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < least:
                raise ConfigurationError(
                    f"{name} must be a {'non-negative' if least == 0 else 'positive'} number "
                    f"of seconds, got {v!r}")


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The interval that minimizes overhead plus expected lost work: sqrt(2 C M)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


class IntervalTuner:
    """Chooses the time between snapshots from measured costs and observed failures."""

    def __init__(self, config: AutoInterval, failures: int = 0, observed_s: float = 0.0,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.config = config
        self.clock = clock or time.monotonic
        self.started = self.clock()
        self.failures = failures
        self.observed_s = observed_s  # training time of the earlier runs
        self.cost_s: float | None = None
        self.interval_s = config.first_snapshot_s
        self.reason = (f"first snapshot after {config.first_snapshot_s:g} s, to measure its cost"
                       if config.first_snapshot_s else
                       "first snapshot at the first step(), to measure its cost")
        self._idle: deque[float] = deque(maxlen=64)  # step times with no write in flight
        self._stall = 0.0  # of the snapshot in flight
        self._excess = 0.0  # its in-run slowdown so far
        self._in_flight = False
        self._measured = 0

    @property
    def mtbf_s(self) -> float:
        seen = self.observed_s + (self.clock() - self.started)
        return (seen + self.config.prior_mtbf_s) / (self.failures + 1)

    def training_step(self, seconds: float, busy: bool) -> None:
        """One step's training time (between ``step()`` calls, stalls excluded); ``busy``:
        whether a snapshot was being written meanwhile."""
        if busy:
            if self._idle:
                self._excess += max(0.0, seconds - statistics.median(self._idle))
            return
        if self._in_flight:
            self._in_flight = False
            self.measured(self._stall + self._excess)
        self._idle.append(seconds)

    def snapshot_started(self, stall_s: float, background: bool) -> None:
        """A snapshot was taken; ``stall_s``: how long ``step()`` blocked for it. With
        ``background``, its slowdown is measured until the write is done."""
        if self._in_flight:  # the previous one never showed as done: charge what it had
            self.measured(self._stall + self._excess)
        self._stall, self._excess = stall_s, 0.0
        self._in_flight = background
        if not background:
            self.measured(stall_s)

    def measured(self, cost_s: float) -> None:
        """A snapshot's whole cost is known: update the cost and choose the interval again.

        The first snapshot of a process is replaced by the second: it paid once for what the
        later ones reuse (staging buffers allocated, every chunk new)."""
        self._measured += 1
        self.cost_s = (cost_s if self.cost_s is None or self._measured == 2
                       else _EMA * cost_s + (1 - _EMA) * self.cost_s)
        self.choose()

    def choose(self) -> float:
        """The interval for the current cost and failure rate (logged when it moves)."""
        if self.cost_s is None:
            return self.interval_s
        c = self.config
        cost, mtbf = max(self.cost_s, 1e-6), self.mtbf_s
        best = young_daly(cost, mtbf)
        interval, why = best, "Young/Daly sqrt(2 C M)"
        if interval < cost / c.max_overhead:
            interval, why = cost / c.max_overhead, f"the {c.max_overhead:.1%} overhead bound"
        if interval > c.max_interval_s:
            interval, why = c.max_interval_s, "the max_interval_s bound"
            if cost / interval > c.max_overhead:
                why += f" (snapshots now cost {cost / interval:.1%} of training)"
        before = self.interval_s
        self.interval_s = interval
        self.reason = (f"{why}: a snapshot costs C = {cost:.3g} s, the job fails every M = "
                       f"{mtbf / 3600:.3g} h ({counted(self.failures, 'interruption')} observed "
                       f"over {(self.observed_s + self.clock() - self.started) / 3600:.3g} h, "
                       f"prior {c.prior_mtbf_s / 3600:.3g} h)")
        if before <= 0:
            log.info("save interval now %.3g s (the first snapshot measured): %s", interval,
                     self.reason)
        elif abs(interval - before) / before > _LOG_CHANGE:
            log.info("save interval now %.3g s (was %.3g s): %s", interval, before, self.reason)
        return interval
