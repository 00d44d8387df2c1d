"""SnapshotManager's signal handlers: managers closed in any order put back the handlers that
were there before them; one request sent by several processes is one; SIGUSR1 where it would
kill the process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager
from ciuic.chain.repo import Repository
from ciuic.manager import signals


def test_managers_closed_in_creation_order_leave_the_original_signal_handlers(
        store_dir: Path) -> None:
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever ran earlier
    try:
        m1 = SnapshotManager("p", job="a", store=store_dir)
        m2 = SnapshotManager("p", job="b", store=store_dir)
        m1.close()
        m2.close()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert not any(getattr(signal.getsignal(s), "__self__", None) in (m1, m2)
                       for s in (signal.SIGINT, signal.SIGTERM))
        # a closed manager's handler, still called by someone's chain, passes the signal on
        with pytest.raises(KeyboardInterrupt):
            m1._signals._on_signal(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, before)


def _trained(store_dir: Path, job: str) -> tuple[SnapshotManager, torch.nn.Module,
                                                  torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = SnapshotManager("p", job=job, store=store_dir, save_interval=100, asynchronous=False)
    m.step(1, model, opt)
    return m, model, opt


def test_the_same_signal_passed_on_by_several_processes_is_one_request(
        store_dir: Path) -> None:
    """Slurm signals every process of a step and torchrun passes on what it got: a worker's
    second SIGTERM within SAME_WITHIN_S is the same request (one emergency snapshot at the
    next step()), not the "again: exit at once" that loses it."""
    # (the second: torchrun's copy, milliseconds later)
    stops_at_step_2(store_dir, "same", signal.SIGTERM, signal.SIGTERM)
    # srun's Ctrl-C: SIGINT to every process of the step, and torchrun's copy
    stops_at_step_2(store_dir, "same-int", signal.SIGINT, signal.SIGINT)


def test_a_persons_second_ctrl_c_exits_at_once(store_dir: Path) -> None:
    """SIGINT's window is short: a second Ctrl-C a moment later (0.4 s) is a person's."""
    m, _, _ = _trained(store_dir, "ctrl-c")
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert m.signal_pending
        time.sleep(signals.SAME_SIGINT_WITHIN_S + 0.1)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # (Python runs the handler at once; this is not reached)
    finally:
        m.close()


def stops_at_step_2(store_dir: Path, job: str, *sent: signal.Signals) -> None:
    """``sent`` after step 1: the next step() takes the emergency snapshot and exits."""
    m, model, opt = _trained(store_dir, job)
    try:
        for sig in sent:
            os.kill(os.getpid(), sig)
        assert m.signal_pending
        with pytest.raises(SystemExit) as exit_:
            m.step(2, model, opt)
        assert exit_.value.code == 128 + sent[0]
        assert latest_step(store_dir, job) == 2
    finally:
        m.close()


def latest_step(store_dir: Path, job: str) -> int | None:
    repo = Repository.open(store_dir)
    try:
        latest = repo.catalog.latest("p", job)
        return None if latest is None else latest.step
    finally:
        repo.close()


def test_a_second_signal_after_the_window_exits_at_once(store_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(signals, "SAME_WITHIN_S", 0.05)
    m, _, _ = _trained(store_dir, "again")
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        with pytest.raises(SystemExit) as exit_:
            os.kill(os.getpid(), signal.SIGTERM)  # the user's second Ctrl-C, or kill
        assert exit_.value.code == 128 + signal.SIGTERM
    finally:
        m.close()


def test_sigusr1_is_a_preemption_notice_where_nothing_else_takes_it(store_dir: Path) -> None:
    """SIGUSR1 (Slurm's --signal=USR1@T) would kill the process: the manager takes it as
    SIGTERM. A handler of the user's own (Lightning's requeue) is left alone, and so is an
    ignored one (ciuic run's workers: ciuic run takes it and passes SIGTERM on)."""
    before = signal.getsignal(signal.SIGUSR1)
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        stops_at_step_2(store_dir, "usr1", signal.SIGUSR1)
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL  # put back
        for own in (signal.SIG_IGN, lambda s, f: None):
            signal.signal(signal.SIGUSR1, own)
            m2 = SnapshotManager("p", job="usr1-own", store=store_dir)
            try:
                assert signal.getsignal(signal.SIGUSR1) is own
            finally:
                m2.close()
    finally:
        signal.signal(signal.SIGUSR1, before)
