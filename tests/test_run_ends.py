"""Where a run stopped and how it ended, said the same way by every message (issue 30): the
emergency snapshot, the run's end record, the next run's "Detected training interruption",
``ciuic run``'s "the job stopped" and ``ciuic log``'s notes all name the run's last ``step()``."""

from __future__ import annotations

import logging
import mmap
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, knobs
from ciuic.chain.repo import Repository
from ciuic.chain.runs import history
from ciuic.format.info import SnapshotInfo
from ciuic.format.records import EventRow, RunRow
from ciuic.supervisor import beat
from tests.conftest import run_train
from tests.models import model_opt

model_and_opt = partial(model_opt, 4, 2)


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4)).sum().backward()
    opt.step()


def ciuic_log(store: Path, job: str, *options: str) -> str:
    run = subprocess.run([sys.executable, "-m", "ciuic", "--store", str(store), "log", *options,
                          job],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "COLUMNS": "400"})
    assert run.returncode == 0, run.stderr
    return run.stdout


def notes(store: Path, project: str, job: str) -> list[str]:
    with Repository.open(store) as repo:
        found = history(repo.catalog.runs(project, job), repo.catalog.events(project, job))
    return [n for ns in found.values() for n in ns]


# -- 3. one step where a run stopped ----------------------------------------------------------

def test_a_signal_stop_is_the_same_step_in_every_message(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Ctrl-C during step 8's update: the emergency snapshot, the end record, the restart and
    the history all say step 8 (the restart said 7: the progress file was written after the
    emergency snapshot's exit)."""
    model, opt = model_and_opt()
    with caplog.at_level(logging.INFO, logger="ciuic"):
        m = SnapshotManager("p", job="int", store=store_dir, save_interval=5)
        for step in range(9):
            train(model, opt)
            if step == 8:
                os.kill(os.getpid(), signal.SIGINT)  # handled: a flag for the next step()
            if step < 8:
                m.step(step, model, opt)
        with pytest.raises(SystemExit) as stopped:
            m.step(8, model, opt)
        assert stopped.value.code == 128 + signal.SIGINT
        again = SnapshotManager("p", job="int", store=store_dir, save_interval=5)
        assert again.restore(model, opt) == 8
        again.close()
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "Emergency snapshot at step 8 saved" in said
    assert "Detected training interruption at step 8 (it was stopped by SIGINT)" in said
    assert again.previous_run is not None and again.previous_run.last_step == 8
    assert any(n.endswith("stopped at step 8: was stopped by SIGINT")
               for n in notes(store_dir, "p", "int"))


def test_log_before_the_restart_names_the_step_the_restart_names(store_dir: Path) -> None:
    """A SIGKILL at step 23, before the heartbeat recorded it (the catalog said step 0): `ciuic
    log` on the same machine reads the run's progress file, as the restart does."""
    train_args = ("--steps", "30", "--save-every", "10", "--sync")
    killed = run_train(store_dir, *train_args, "--kill-at", "23")
    assert killed.rc == -9
    before = ciuic_log(store_dir, "tests/mlp")
    assert re.search(r"then run \w+ stopped at step 23: was killed or crashed", before), before
    again = run_train(store_dir, *train_args)
    assert again.rc == 0, again.err
    assert "Detected training interruption at step 23 (it was killed or crashed" in again.err
    after = ciuic_log(store_dir, "tests/mlp")
    assert re.search(r"then run \w+ stopped at step 23: was killed or crashed", after), after


def test_the_supervisor_reads_a_closed_ranks_last_step_and_commit() -> None:
    """A rank that closed its manager (or left its `with` block by an exception) right after its
    last step(): its slot still says where it got to, and is not watched for a hang. (The slot
    was wiped: `ciuic run` said the step of its last poll, or "before its first step()".)"""
    region = mmap.mmap(-1, beat.REGION_BYTES)
    b = beat.Beacon(region, 0, 0, os.getpid())
    b.started()
    for step in range(18):
        b.step(step)
        if step % 5 == 0:
            b.committed(step)
    b.detach()
    [seen] = beat.read(region)
    assert (seen.pid, seen.step, seen.committed, seen.commits) == (os.getpid(), 17, 15, 4)
    assert seen.silent_s(time.monotonic() + 3600) == 0.0  # done: never a hang


# -- 4. short runs under ciuic run; a non-zero exit is a cause ---------------------------------

SHORT_JOB = """
import sys
import torch
from torch import nn
from ciuic import SnapshotManager

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with SnapshotManager("short", job="j", store=sys.argv[1], save_interval=100) as m:
    last = m.restore(model, opt)
    for step in range(0 if last is None else last + 1, 3):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        m.step(step, model, opt)
    sys.exit(3)
"""


# the README's seed-style loop: no `with`, no close(); argv[2] "caught": exits that do not end
# the process (another thread's sys.exit, a caught one), then the script's normal end
PLAIN_JOB = """
import sys
import threading
import torch
from torch import nn
from ciuic import SnapshotManager

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
m = SnapshotManager("short", job="j", store=sys.argv[1], save_interval=100)
last = m.restore(model, opt)
for step in range(0 if last is None else last + 1, 3):
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    m.step(step, model, opt)
    if sys.argv[2:] == ["caught"] and step == 1:
        thread = threading.Thread(target=sys.exit, args=(4,))
        thread.start()
        thread.join()
        try:
            sys.exit(5)
        except SystemExit:
            pass
if sys.argv[2:] != ["caught"]:
    sys.exit(3)
"""


@pytest.mark.parametrize("script", [SHORT_JOB, PLAIN_JOB], ids=["with", "no-close"])
def test_a_short_job_that_exits_3_under_ciuic_run(tmp_path: Path, script: str) -> None:
    """step(0..2), then exit 3, twice: the first start committed snapshot 0 (progress: restarted
    at once), the restart ran steps 1-2 from it and committed none. Every message says step 2;
    the exit is each run's cause in `ciuic log`. (It said step 0, "before its first step()",
    "without committing a new snapshot", and `ciuic log` showed no cause; without `with` or
    close(), the last start, which made `ciuic run` give up, showed no note: its end was 'exit',
    a clean one.)"""
    job, store = tmp_path / "job.py", tmp_path / "store"
    job.write_text(script)
    run = subprocess.run(
        [sys.executable, "-m", "ciuic", "run", "--max-stalls", "1", "--host-memory", "off",
         "--", sys.executable, str(job), str(store)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    err = run.stderr
    assert run.returncode == 3, err[-3000:]
    assert re.search(r"ciuic run: the job stopped at step 2: exit status 3\b.*\. Restart 1 "
                     r"of at most 10 now", err), err[-3000:]
    assert "Detected training interruption at step 2 (exit status 3" in err
    assert "Resuming training at step 1" in err
    assert ("giving up: it failed 1 time in a row without committing a snapshot past step 0. "
            "The last failure, at step 2: exit status 3") in err
    shown = ciuic_log(store, "short/j")
    assert re.search(r"then run \w+ stopped at step 2: exit status 3", shown), shown
    assert re.search(r"then run \w+ stopped at step 2: exited with status 3", shown), shown


def test_sys_exit_with_a_status_inside_the_with_block_is_the_runs_end(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with pytest.raises(SystemExit), SnapshotManager("p", job="exit3", store=store_dir,
                                                     save_interval=100) as m:
        for step in range(3):
            train(model, opt)
            m.step(step, model, opt)
        sys.exit(3)
    with Repository.open(store_dir) as repo:
        [r] = repo.catalog.runs("p", "exit3")
    assert (r.end_kind, r.last_step) == ("exit:3", 2)
    assert any(n.endswith("stopped at step 2: exited with status 3")
               for n in notes(store_dir, "p", "exit3"))
    with SnapshotManager("p", job="exit3", store=store_dir, save_interval=100) as again:
        assert again.interrupted


def test_sys_exit_with_a_status_without_close_is_the_runs_end(tmp_path: Path) -> None:
    """The seed-style loop (no `with`, no close()) that ends with sys.exit(3): the run's end is
    exit:3, not a clean one (it was 'exit': atexit is not told the status), and `ciuic log` says
    so. A sys.exit that does not end the process (another thread's, a caught one followed by
    more steps) is not the run's end: the script's normal end is clean."""
    job, store = tmp_path / "job.py", tmp_path / "store"
    job.write_text(PLAIN_JOB)
    exited = subprocess.run([sys.executable, str(job), str(store)], capture_output=True,
                            text=True, timeout=120)
    assert exited.returncode == 3, exited.stderr[-3000:]
    with Repository.open(store) as repo:
        [r] = repo.catalog.runs("short", "j")
    assert (r.end_kind, r.last_step) == ("exit:3", 2)
    shown = ciuic_log(store, "short/j")
    assert re.search(r"then run \w+ stopped at step 2: exited with status 3", shown), shown
    again = subprocess.run([sys.executable, str(job), str(store), "caught"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Detected training interruption at step 2 (it exited with status 3)" in again.stderr
    with Repository.open(store) as repo:
        [_, second] = repo.catalog.runs("short", "j")
    assert (second.end_kind, second.last_step) == ("exit", 2)


# -- 5. a full disk ----------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of its own, to fill. Mounting needs root (or CAP_SYS_ADMIN): elsewhere the
    test is skipped, with the reason."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                                 capture_output=True, text=True, timeout=30)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs to fill ({e}): the full-disk test needs mount(8)")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill ({mounted.stderr.strip()}): the full-disk "
                    "test needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError as e:
        assert e.errno == 28  # ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_full_disk_is_said_in_ciuic_words_and_a_clean_end_is_not_called_a_kill(
        small_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The catalog's disk fills up mid-run; the run goes on and finishes. The warnings say what
    is full, what was not recorded and what to do (the first was SQLAlchemy's "(sqlite3.
    OperationalError) database or disk is full (Background on this error at: ...)"); `ciuic
    log` does not call the run killed (it said "was killed or crashed"), and the next run
    records its end (it said "Detected training interruption")."""
    store, model, opt = small_disk / "store", *model_and_opt()
    with caplog.at_level(logging.INFO, logger="ciuic"), knobs.override(heartbeat_interval_s=0.0):
        # compression off: "auto" probes the store's write speed with up to 256 MiB, which
        # fills this disk on its own
        m = SnapshotManager("p", job="full", store=store, save_interval=1000,
                            compression="off")
        for step in range(20):
            if step == 5:
                m.wait()
                filler = fill(small_disk)
            train(model, opt)
            m.step(step, model, opt)
        m.close()
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert "OperationalError" not in warned and "sqlalche.me" not in warned, warned
    full = f"the catalog {store / 'catalog.db'} cannot be written: the disk that holds it is full"
    assert warned.count(full) == 2, warned  # progress once (not every step), and the end
    assert "The run's progress (step 5) is not recorded there" in warned
    assert re.search(r"The end of run \w+ \(clean, at step 19\) is not recorded there; it is "
                     r"kept in \S+ for the next run of this job on this machine", warned), warned
    assert "Free space on that disk" in warned
    shown = ciuic_log(store, "p/full")  # the disk still full
    assert "killed" not in shown and "stopped" not in shown, shown
    filler.unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ciuic"), SnapshotManager(
            "p", job="full", store=store, save_interval=1000, compression="off") as again:
        assert again.restore(model, opt) == 0
        assert not again.interrupted
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "Detected training interruption" not in said
    with Repository.open(store) as repo:
        first = repo.catalog.runs("p", "full")[0]
    assert (first.end_kind, first.last_step) == ("clean", 19)


def test_a_run_with_no_end_seen_from_another_machine_is_not_called_killed() -> None:
    """No end recorded, no progress file here, no later run's word: how it ended is not known
    (killed, crashed, or its catalog full), and its step is a lower bound."""
    run = RunRow(id="a" * 16, job_id=1, started="2026-12-01T00:00:00.000000Z",
                 host="another-machine", pid=4242, last_step=641,
                 last_seen="2026-12-01T00:10:00.000000Z", ended=None, end_kind=None, cause=None,
                 restart=None)
    events = [EventRow(run=run.id, at="2026-12-01T00:05:00.000000Z", kind="snapshot", step=600,
                       detail="s" * 64)]
    [note] = history([run], events)["s" * 64]
    assert note == ("then run aaaaaaaa stopped after step 641: its end is not known: none was "
                    "recorded (it was killed or crashed, or could not write to its catalog)")
    died = replace(events[0], kind="stopped", at="2026-12-01T01:00:00.000000Z",
                   detail="no end was recorded: it was killed or crashed")
    [note] = history([run], [*events, died])["s" * 64]  # the next run read its progress file
    assert note.endswith("stopped at step 641: was killed or crashed: no clean exit was "
                         "recorded")


def test_events_a_server_recorded_twice_make_one_note_each() -> None:
    """A server's catalog from before reports were idempotent holds each event of a resent run
    twice: `resumed by run R` once, not twice."""
    run = RunRow(id="b" * 16, job_id=1, started="2026-12-01T00:00:00.000000Z", host="elsewhere",
                 pid=1, last_step=9, last_seen="2026-12-01T00:01:00.000000Z",
                 ended="2026-12-01T00:01:00.000000Z", end_kind="clean", cause=None,
                 restart=None)
    resumed = EventRow(run=run.id, at="2026-12-01T00:00:01.000000Z", kind="restore", step=5,
                       detail="s" * 64)
    assert history([run], [resumed, resumed]) == {"s" * 64: ["resumed by run bbbbbbbb"]}


def _at(minute: int) -> str:
    return f"2026-12-01T00:{minute:02d}:00.000000Z"


def _snap(step: int, parent: str, minute: int, status: str = "committed") -> SnapshotInfo:
    return SnapshotInfo(id=f"{step:064d}", project="p", job="j", step=step, parent=parent,
                        created=_at(minute), total_bytes=1, new_bytes=1, tensors=1,
                        status=status, seq=step // 100)


def test_a_stop_is_noted_on_the_run_s_latest_snapshot_at_or_before_its_step() -> None:
    """The quick-start kill: run 1 committed 100 and 200 (200's event never reached the
    catalog) and was killed at step 300; run 2 resumed from 200 and committed 300 to 700. The
    note goes on 200, with `resumed by` (it went on 100, the last recorded event); not on run
    2's 300. With keep_last=5 (100 and 200 pruned) plain `ciuic log` still shows it, on the
    first listed snapshot after it; with keep_every keeping 100, on 100."""
    one = RunRow(id="1" * 16, job_id=1, started=_at(0), host="elsewhere", pid=1,
                 last_step=300, last_seen=_at(4), ended=None, end_kind=None, cause=None,
                 restart=None)
    two = replace(one, id="2" * 16, started=_at(10), last_step=700, last_seen=_at(20),
                  ended=_at(20), end_kind="clean")
    snaps = [_snap(100, "", 1), _snap(200, f"{100:064d}", 3)]
    snaps += [_snap(step, f"{step - 100:064d}", 10 + step // 100) for step in range(300, 800, 100)]
    events = [EventRow(run=one.id, at=_at(1), kind="snapshot", step=100, detail=snaps[0].id),
              EventRow(run=one.id, at=_at(11), kind="stopped", step=300, detail="killed"),
              EventRow(run=two.id, at=_at(11), kind="restore", step=200, detail=snaps[1].id)]
    events += [EventRow(run=two.id, at=s.created, kind="snapshot", step=s.step, detail=s.id)
               for s in snaps[2:]]
    stopped = ("then run 11111111 stopped at step 300: was killed or crashed: no clean exit was "
               "recorded")
    assert history([one, two], events, snaps) == {
        snaps[1].id: [stopped, "resumed by run 22222222"]}
    assert history([one, two], events) == {  # without the snapshots: at the last event
        snaps[0].id: [stopped], snaps[1].id: ["resumed by run 22222222"]}
    kept = [replace(s, status="pruned") if s.step <= 200 else s for s in snaps]
    assert history([one, two], events, kept)[snaps[2].id] == [
        "before this, run 11111111 stopped at step 300: was killed or crashed: no clean exit "
        "was recorded"]
    assert history([one, two], events, kept, listed_pruned=True)[snaps[1].id][0] == stopped
    kept = [replace(s, status="pruned") if s.step == 200 else s for s in snaps]
    assert history([one, two], events, kept)[snaps[0].id] == [stopped]


def test_plain_log_shows_a_kill_whose_snapshots_retention_pruned(store_dir: Path) -> None:
    """keep_last=2, killed at step 13 after snapshots 5 and 10, resumed to the end: the kill's
    note was on snapshot 10, pruned, so plain `ciuic log` showed no trace of it."""
    train_args = ("--steps", "30", "--save-every", "5", "--keep-last", "2", "--sync")
    assert run_train(store_dir, *train_args, "--kill-at", "13").rc == -9
    assert run_train(store_dir, *train_args).rc == 0
    shown = ciuic_log(store_dir, "tests/mlp")
    assert re.search(r"before this, run \w+ stopped at step 13: was killed or crashed",
                     shown), shown
    every = ciuic_log(store_dir, "tests/mlp", "--all")
    assert re.search(r"then run \w+ stopped at step 13: was killed", every), every
