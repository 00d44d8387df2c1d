"""The cause a restarted run records and says, when ``ciuic run`` learns it only after the run
started (issue 42, item 5): a node's workers that only lost their connection to a lost node's
rank restart before that node's word arrives. The run must not name its predecessor's own
exception (gloo's "Connection reset by peer", a consequence) as the cause: it says the cause is
not known yet, asks its ``ciuic run`` on its ``step()`` calls, and records and says the cause
once named."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager
from ciuic.chain.repo import Repository
from ciuic.manager import supervised
from ciuic.supervisor.holder import Holder

#: the previous generation's rank 0: five snapshot steps, then its collective fails because a
#: rank on another node is gone (what gloo raises there)
FIRST = """
import os, sys, torch
from ciuic import SnapshotManager
m = SnapshotManager("late", store=sys.argv[1], save_interval=5, asynchronous=False)
model = torch.nn.Linear(2, 2)
for step in range(8):
    m.step(step, model)
print(os.getpid(), flush=True)
raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
"""

GONE = "node 1 (10.0.0.2): its ciuic run is gone (the node is down, or ciuic run was killed)"


def restarted(store: Path, monkeypatch: pytest.MonkeyPatch) -> Holder:
    """The previous generation ran and failed; a holder (this node's ``ciuic run``) that says
    torchrun restarted the workers, before it knew why; its channel in this process's
    environment. Asked on every step()."""
    first = subprocess.run([sys.executable, "-c", FIRST, str(store)], capture_output=True,
                           text=True, timeout=120)
    assert first.returncode == 1 and "Connection closed by peer" in first.stderr, first.stderr
    holder = Holder(budget=None)
    for name, value in holder.new_start().items():
        monkeypatch.setenv(name, value)
    holder.restart = {"number": 1, "cause": "", "stopped_at": 7,
                      "pids": [int(first.stdout.split()[0])]}
    monkeypatch.setattr(supervised, "CAUSE_ASK_EVERY_S", 0.0)
    return holder


def test_a_cause_named_after_the_restart_is_asked_for_recorded_and_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    holder = restarted(store, monkeypatch)
    try:
        model = torch.nn.Linear(2, 2)
        with caplog.at_level(logging.INFO, logger="ciuic"):
            m = SnapshotManager("late", store=str(store), save_interval=5, asynchronous=False)
            try:
                assert m.restore(model) == 5
                detected = [r.getMessage() for r in caplog.records
                            if r.getMessage().startswith("Detected training interruption")]
                assert detected == ["Detected training interruption at step 7 (the cause is not "
                                    "known yet: ciuic run names it when another node's word "
                                    "arrives, and this run records it then)"], detected
                m.step(6, model)
                assert "The cause of the interruption" not in caplog.text  # still not named
                assert holder.restart is not None
                holder.restart = {**holder.restart, "cause": GONE}  # another node's word
                m.step(7, model)
                assert ("The cause of the interruption at step 7, named by ciuic run after this "
                        f"run started: {GONE}") in caplog.text, caplog.text
                caplog.clear()
                m.step(8, model)  # said once
                assert "The cause of the interruption" not in caplog.text
            finally:
                m.close()
        assert "RuntimeError" not in "\n".join(
            r.getMessage() for r in caplog.records if "interruption" in r.getMessage())
        repo = Repository.open(store)
        try:
            runs = repo.catalog.runs("late", "default")
            assert [r.cause for r in runs] == [GONE, None] and runs[1].restart == 1
        finally:
            repo.close()
    finally:
        holder.close()


def test_a_cause_never_named_is_said_to_be_unknown_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """ciuic run waited for another node's word and none came: the run says once that the
    cause is still not known, and records nothing it does not know (the previous run's own
    end stays what it recorded)."""
    store = tmp_path / "store"
    holder = restarted(store, monkeypatch)
    try:
        monkeypatch.setattr(supervised, "CAUSE_ASK_S", 0.0)
        model = torch.nn.Linear(2, 2)
        with caplog.at_level(logging.INFO, logger="ciuic"), SnapshotManager(
                "late", store=str(store), save_interval=5, asynchronous=False) as m:
            m.restore(model)
            for step in range(6, 9):
                m.step(step, model)
        said = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("The cause of the interruption")]
        assert said == ["The cause of the interruption at step 7 is still not known: ciuic run "
                        "named none (its log says what it saw)"], said
        repo = Repository.open(store)
        try:
            prev = repo.catalog.runs("late", "default")[0]
            assert prev.cause is None and prev.end_kind == "exception:RuntimeError"
        finally:
            repo.close()
    finally:
        holder.close()


def test_a_cause_named_while_the_run_closes_is_still_recorded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that ends a few steps after its restart (here: at once) may end before its
    ``ciuic run`` has the other node's word: rank 0 waits a little at its close, asking, and
    records the cause named then (a multi-node test's short job lost it before)."""
    store = tmp_path / "store"
    holder = restarted(store, monkeypatch)
    try:
        model = torch.nn.Linear(2, 2)

        def named_later() -> None:
            time.sleep(0.6)
            assert holder.restart is not None
            holder.restart = {**holder.restart, "cause": GONE}

        word = threading.Thread(target=named_later)
        with caplog.at_level(logging.INFO, logger="ciuic"):
            m = SnapshotManager("late", store=str(store), save_interval=5, asynchronous=False)
            m.restore(model)
            m.step(6, model)
            word.start()
            t0 = time.monotonic()
            m.close()
            waited = time.monotonic() - t0
        word.join()
        assert ("The cause of the interruption at step 7, named by ciuic run after this run "
                f"started: {GONE}") in caplog.text, caplog.text
        assert waited < supervised.CAUSE_AT_CLOSE_S  # it stopped waiting once named
        repo = Repository.open(store)
        try:
            assert [r.cause for r in repo.catalog.runs("late", "default")] == [GONE, None]
        finally:
            repo.close()
    finally:
        holder.close()


def test_a_cause_not_named_by_the_close_is_said_to_be_unknown(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """No word within the wait at the close: the run says so once and records nothing."""
    store = tmp_path / "store"
    holder = restarted(store, monkeypatch)
    monkeypatch.setattr(supervised, "CAUSE_AT_CLOSE_S", 0.5)
    try:
        model = torch.nn.Linear(2, 2)
        with caplog.at_level(logging.INFO, logger="ciuic"), SnapshotManager(
                "late", store=str(store), save_interval=5, asynchronous=False) as m:
            m.restore(model)
            m.step(6, model)
        said = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("The cause of the interruption")]
        assert said == ["The cause of the interruption at step 7 is still not known at this "
                        "run's end (ciuic run's log says what it saw)"], said
        repo = Repository.open(store)
        try:
            assert repo.catalog.runs("late", "default")[0].cause is None
        finally:
            repo.close()
    finally:
        holder.close()
