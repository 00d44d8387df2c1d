"""When a snapshot is taken: the triggers (a step count, a time interval, a signal), what a due
snapshot does while the previous one is still being written (``on_busy``), and, multi-rank, the
agreement that makes every rank decide the same at the same step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ciuic import knobs
from ciuic.distributed.collective import Collective
from ciuic.manager.config import ManagerConfig
from ciuic.manager.interval import IntervalTuner
from ciuic.manager.stats import ManagerStats

log = logging.getLogger("ciuic")
#: a wait for the previous snapshot is worth a warning from this share of the interval
WAIT_SHARE = 0.1


class SavePolicy:
    """Decides, at each ``step()``, whether a snapshot is due."""

    def __init__(self, config: ManagerConfig, coll: Collective, stats: ManagerStats) -> None:
        self.save_interval = config.save_interval
        self.time_interval_s = config.time_interval_s
        #: save_interval="auto": the time between snapshots, chosen from their measured cost
        #: and the job's failure rate (manager/interval.py)
        self.tuner: IntervalTuner | None = None
        # under torchrun, skipping would have to be agreed by every rank: they all wait
        self.on_busy = "wait" if coll.enabled else config.on_busy
        self.coll = coll
        self.stats = stats
        self.last_save_step: int | None = None
        self.last_save_time = time.monotonic()
        self._warned_busy = False
        self._waits_in_a_row = 0
        self._warned_steps = False
        self._agreement: Callable[[], list[int]] | None = None
        self._step_calls = 0
        self._steps_disagree = False
        self._last_exit: float | None = None  # when the last step() returned (for the tuner)
        if coll.enabled and config.on_busy == "skip" and coll.coordinator:
            log.warning("on_busy='skip' is not used under torchrun: skipping would have to "
                        "be agreed by every rank, so a due snapshot waits for the previous "
                        "one on every rank instead")

    def due(self, step: int, time_due: bool) -> bool:
        """Whether step ``step`` takes a snapshot: by its number, or because ``time_due``."""
        if step == self.last_save_step:
            return False
        return bool(self.save_interval and step % self.save_interval == 0) or time_due

    def time_due(self, now: float) -> bool:
        """Whether ``time_interval_s`` (or the automatic interval) has passed since the last
        snapshot."""
        if self.tuner is not None:  # its first interval may be 0: at the first step()
            return now - self.last_save_time >= self.tuner.interval_s
        return bool(self.time_interval_s and now - self.last_save_time >= self.time_interval_s)

    def auto(self, tuner: IntervalTuner) -> None:
        """Let ``tuner`` choose the time between snapshots; it counts from now."""
        self.tuner = tuner
        self.last_save_time = time.monotonic()
        self._show_interval()

    def timed(self, step: Callable[[], bool], busy: Callable[[], bool], background: bool) -> bool:
        """Run one ``step()`` call (``step``: whether it took a snapshot). With an automatic
        interval, the tuner learns the training time since the previous call returned
        (``busy``: whether a snapshot was being written meanwhile) and a snapshot's stall."""
        tuner = self.tuner
        if tuner is None:
            return step()
        t0 = time.monotonic()
        if self._last_exit is not None:  # the training time since the last step() returned
            tuner.training_step(t0 - self._last_exit, busy())
        took = step()
        self._last_exit = time.monotonic()
        if took:
            tuner.snapshot_started(self._last_exit - t0, background=background)
        self._show_interval()
        return took

    def _show_interval(self) -> None:
        tuner = self.tuner
        if tuner is not None:
            self.stats.interval_s = tuner.interval_s
            self.stats.interval_reason = tuner.reason
            self.stats.snapshot_cost_s = tuner.cost_s
            self.stats.mtbf_s = tuner.mtbf_s

    def taken(self, step: int) -> None:
        """A snapshot of ``step`` was started (or restored): the intervals count from here."""
        self.last_save_step = step
        self.last_save_time = time.monotonic()

    def proceed_while_busy(self, step: int, wait: Callable[[], None]) -> bool:
        """A snapshot is due while the previous one is being written: wait for it (``"wait"``)
        and return True, or count a skip and return False (``"skip"``)."""
        if self.on_busy == "skip":
            self.stats.skipped += 1
            if not self._warned_busy:
                self._warned_busy = True
                log.warning("snapshot at step %d skipped: the previous one is still being "
                            "written (last took %.2f s). Snapshots are skipped, not queued, "
                            "while one is in flight; see stats.skipped, or pass "
                            "on_busy='wait'", step, self.stats.last_save_s)
            return False
        since = time.monotonic() - self.last_save_time  # training time since the last one
        # the process's first snapshot pays once for what the later ones reuse (staging
        # buffers, the store's probes, every chunk new): a wait for it says nothing of the rate
        first = self.stats.snapshots + self.stats.failures == 0
        t0 = time.perf_counter()
        wait()
        waited = time.perf_counter() - t0
        self.stats.waited_s += waited
        if first:
            log.debug("snapshot at step %d waited %.2f s for the first one", step, waited)
            return True
        # worth a warning when the wait matters: a tenth of the interval, or three in a row
        self._waits_in_a_row = self._waits_in_a_row + 1 if waited > 0.05 else 0
        share = waited / max(since, 1e-9)
        if not self._warned_busy and waited > 0.05 and (
                share >= WAIT_SHARE or self._waits_in_a_row >= 3):
            self._warned_busy = True
            # no compute between the two (a percentage of ~0 s said '15778 %', issue 30)
            share_text = ("the steps between the two snapshots took under 10 ms"
                          if since < 0.01 else
                          f"{100 * share:.0f} % of the {since:.2f} s of training since "
                          "the previous snapshot began")
            log.warning("snapshot at step %d waited %.2f s for the previous one to be "
                        "written (%s%s): snapshots are due faster than they are written. "
                        "Consider a larger save_interval, or on_busy='skip'", step, waited,
                        share_text, f"; {self._waits_in_a_row} waits in a row"
                        if self._waits_in_a_row >= 3 else "")
        return True

    # -- multi-rank ------------------------------------------------------------------------

    def agree(self, step: int) -> tuple[bool, int, bool]:
        """Multi-rank: (whether a snapshot is due, a signal any rank received, whether any
        rank's snapshot failed in a way that repeats), decided identically on every rank.

        A step count makes a snapshot due on every rank at once. What one rank alone can see (a
        signal, the elapsed time interval) is shared by a small all-reduce that every rank
        starts at the end of every ``dist_agree_every_steps``-th ``step()`` without waiting for
        it (:meth:`post_agreement`) and reads at the next ``step()``: its latency hides behind
        a training step, and every rank acts on the same values at the same step. A signal
        stops every rank at that step, whether the ranks' steps agree or not.
        """
        self._step_calls += 1
        due_t = 0
        pending, self._agreement = self._agreement, None
        if pending is not None:
            sig, due_t, hi, neg_lo, fatal = pending()
            if fatal:
                return False, 0, True
            if sig:
                return True, sig, False
            if hi != -neg_lo:
                if not self._warned_steps:
                    self._warned_steps = True
                    log.error("ranks called step() with different steps (%d to %d): no snapshot "
                              "is taken until they agree; call manager.step(step, ...) with the "
                              "same step on every rank", -neg_lo, hi)
                self._steps_disagree = True
                return False, 0, False
            self._steps_disagree = False
        if self._steps_disagree:
            return False, 0, False
        return self.due(step, bool(due_t)), 0, False

    def post_agreement(self, step: int, signal: int | None, fatal: bool = False) -> None:
        """Start the all-reduce that the next ``step()`` reads (see :meth:`agree`); ``fatal``:
        this rank's last snapshot failed in a way that repeats (a CaptureError)."""
        if (self._step_calls - 1) % knobs.get().dist_agree_every_steps:
            return
        # an automatic interval is rank 0's (it alone reads the job's failure history): the
        # other ranks' choices would otherwise make the shortest of them win
        time_due = (self.time_due(time.monotonic())
                    if self.tuner is None or self.coll.coordinator else False)
        self._agreement = self.coll.start_max([signal or 0, int(time_due), step, -step,
                                               int(fatal)])

    def abandon(self) -> None:
        """In-process recovery: a started agreement is not waited for (its group is aborted)."""
        self._agreement = None

    def close(self) -> None:
        """Let a started agreement finish before the groups go (a dead peer fails it: the
        error is ignored)."""
        pending, self._agreement = self._agreement, None
        if pending is not None:
            try:
                pending()
            except Exception as e:
                log.debug("the last step agreement failed at close: %s", e)
