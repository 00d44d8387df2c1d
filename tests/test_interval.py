"""``save_interval="auto"``: Young/Daly's interval from the measured cost of a snapshot and the
job's observed failure rate, within the overhead and time bounds."""

from __future__ import annotations

import math
import random
import secrets
import time
from pathlib import Path

import pytest
import torch

from ciuic import AutoInterval, SnapshotManager, faults, knobs
from ciuic.chain.repo import Repository
from ciuic.errors import ConfigurationError
from ciuic.manager.interval import IntervalTuner, young_daly
from tests.models import model_opt


class SimClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def simulate(failures: list[float], cost: float, horizon: float,
             fixed: float | None = None, config: AutoInterval | None = None) -> float:
    """The share of ``horizon`` seconds of wall time lost to snapshots and to the work redone
    after each failure (``failures``: the times between them, drawn once). Each run is a new
    tuner that reads the job's earlier runs (interruptions, time observed), as the manager
    does; ``fixed``: a constant interval instead."""
    config = config or AutoInterval()
    clock = SimClock()
    wall = kept = 0.0  # total time; work that reached a durable snapshot
    observed = 0.0
    for n_failed, gap in enumerate(failures):
        run_end = min(gap, horizon - wall)
        clock.t = t = 0.0
        tuner = IntervalTuner(config, n_failed, observed, clock=clock)
        while True:
            interval = fixed if fixed is not None else tuner.interval_s
            if t + interval + cost > run_end:
                break  # the run fails before the next snapshot is durable: that work is lost
            kept += interval
            clock.t = t = t + interval + cost
            tuner.snapshot_started(cost, background=False)
        wall += run_end
        observed += run_end
        if wall >= horizon:
            break
    return (wall - kept) / wall


def test_the_automatic_interval_comes_within_ten_percent_of_the_optimum() -> None:
    """Failures at a known rate (one a day; the prior says one a week), snapshots that cost
    10 s: the tuner learns the rate from the runs' interruptions, and the time it loses (snapshot
    overhead plus work redone) is within 10 % of the best fixed interval's on the same draws."""
    rng = random.Random(7)
    mtbf, cost = 24 * 3600.0, 10.0
    horizon = 400 * mtbf
    draws = [rng.expovariate(1 / mtbf) for _ in range(2000)]
    config = AutoInterval(prior_mtbf_s=7 * mtbf)
    auto = simulate(draws, cost, horizon, config=config)
    grid = [200.0 * 1.15 ** k for k in range(26)]  # 200 s .. 1.8 h
    fixed = {tau: simulate(draws, cost, horizon, fixed=tau) for tau in grid}
    best_tau = min(fixed, key=lambda k: fixed[k])
    assert auto <= 1.10 * fixed[best_tau], (auto, best_tau, fixed[best_tau])
    # the optimum is where Young/Daly says, and the analytic waste is what was measured
    assert 0.6 < best_tau / young_daly(cost, mtbf) < 1.6
    assert fixed[best_tau] == pytest.approx(math.sqrt(2 * cost / mtbf), rel=0.25)


def test_bounds_and_the_reason_for_the_choice(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="ciuic")
    clock = SimClock()
    t = IntervalTuner(AutoInterval(max_overhead=0.01, max_interval_s=3600,
                                   prior_mtbf_s=1e9), clock=clock)
    assert t.interval_s == 0.0 and "first step()" in t.reason
    t.snapshot_started(20.0, background=False)  # Young/Daly: 200 000 s; capped at an hour
    assert t.interval_s == 3600 and "max_interval_s" in t.reason
    assert ("save interval now 3.6e+03 s (the first snapshot measured): the max_interval_s "
            "bound") in caplog.text
    t = IntervalTuner(AutoInterval(prior_mtbf_s=100.0), clock=clock)
    t.snapshot_started(5.0, background=False)  # Young/Daly: 31.6 s, but 1 % overhead: 500 s
    assert t.interval_s == pytest.approx(500.0) and "overhead bound" in t.reason
    t = IntervalTuner(AutoInterval(max_interval_s=100.0, prior_mtbf_s=1e6), clock=clock)
    t.snapshot_started(5.0, background=False)  # 1 % overhead needs 500 s, but at most 100 s
    assert t.interval_s == 100.0 and "snapshots now cost 5.0%" in t.reason
    for bad in ({"max_overhead": 0}, {"max_overhead": 1.5}, {"max_interval_s": -1},
                {"prior_mtbf_s": "day"}):
        with pytest.raises(ConfigurationError):
            AutoInterval(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="'auto'"):
        SnapshotManager("p", save_interval="often")
    with pytest.raises(ConfigurationError, match="drop time_interval_s=30"):
        SnapshotManager("p", save_interval="auto", time_interval_s=30)


def test_the_slowdown_of_a_background_write_counts_in_the_cost() -> None:
    clock = SimClock()
    t = IntervalTuner(AutoInterval(prior_mtbf_s=1e9), clock=clock)
    for _ in range(10):
        t.training_step(0.1, busy=False)
    t.snapshot_started(0.05, background=True)
    for _ in range(5):
        t.training_step(0.3, busy=True)  # 0.2 s slower each while the write runs
    assert t.cost_s is None
    t.training_step(0.1, busy=False)  # the write is done
    assert t.cost_s == pytest.approx(0.05 + 5 * 0.2)


def _train(store: Path, job: str, seconds: float, auto: AutoInterval) -> SnapshotManager:
    net, opt = model_opt(256, 256, 256, lr=1e-3)
    m = SnapshotManager("p", job=job, store=store, save_interval=auto, asynchronous=False,
                        handle_signals=False, compression="off", health=False)
    end = time.monotonic() + seconds
    step = 0
    while time.monotonic() < end:
        opt.zero_grad()
        net(torch.randn(8, 256)).sum().backward()
        opt.step()
        m.step(step, net, opt)
        step += 1
        time.sleep(0.002)
    return m


def test_the_interval_grows_with_a_slower_store_and_shrinks_with_failures(
        store_dir: Path) -> None:
    auto = AutoInterval(max_overhead=0.5, prior_mtbf_s=10.0, first_snapshot_s=0.2)
    with knobs.override(chunk_bytes=64 * 1024):  # 8 chunks of weights, written 4 at a time
        fast = _train(store_dir, "fast", 2.5, auto)
        fast.close()
        faults.reload("chunk.put=sleep:0.1")
        try:
            slow = _train(store_dir, "slow", 3.5, auto)
            slow.close()
        finally:
            faults.reload("")
    assert fast.stats.snapshot_cost_s is not None and slow.stats.snapshot_cost_s is not None
    assert slow.stats.snapshot_cost_s > 3 * fast.stats.snapshot_cost_s
    assert fast.stats.interval_s is not None and slow.stats.interval_s is not None
    assert slow.stats.interval_s > 1.5 * fast.stats.interval_s
    assert "Young/Daly" in slow.stats.interval_reason
    assert fast.stats.snapshots >= 2 and slow.stats.snapshots >= 2

    # three earlier runs of job "fast" were interrupted (a kill leaves no end; a signal does)
    with Repository.open(store_dir) as repo:
        for kind in ("signal:SIGTERM", "exception:RuntimeError", "signal:SIGKILL"):
            run = secrets.token_hex(8)
            repo.catalog.start_run("p", "fast", run)
            repo.catalog.end_run(run, kind)
    again = _train(store_dir, "fast", 1.0, auto)
    again.close()
    assert "3 interruptions observed" in again.stats.interval_reason
    assert again.stats.mtbf_s is not None and fast.stats.mtbf_s is not None
    assert again.stats.mtbf_s < fast.stats.mtbf_s / 2
    assert again.stats.interval_s is not None
    expected = young_daly(again.stats.snapshot_cost_s or 0, again.stats.mtbf_s)
    assert again.stats.interval_s == pytest.approx(max(expected, 2 * (
        again.stats.snapshot_cost_s or 0)), rel=0.05)


def test_the_first_automatic_snapshot_is_taken_at_the_first_step(store_dir: Path) -> None:
    """A crash in the job's first minute still has a snapshot to resume from: the first one is
    the measurement of the cost, at the first step()."""
    net, opt = model_opt(16, 16, lr=1e-3)
    with SnapshotManager("p", job="early", store=store_dir, save_interval="auto",
                         handle_signals=False) as m:
        assert "first step()" in (m.stats.interval_reason or "")
        m.step(0, net, opt)
        m.wait()
        assert m.stats.snapshots == 1
        m.step(1, net, opt)  # the next is due after the measured interval, not at once
        m.wait()
        assert m.stats.snapshots == 1
    with Repository.open(store_dir) as repo:
        assert 0 in [s.step for s in repo.catalog.snapshots("p", "early")]
    with pytest.raises(ConfigurationError, match="first_snapshot_s must be a non-negative"):
        AutoInterval(first_snapshot_s=-1)
