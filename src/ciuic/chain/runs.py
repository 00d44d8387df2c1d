"""How runs end: clean exits, uncaught exceptions and termination signals, recorded so that the
next run of the job can say how the previous one was interrupted.

A run that was killed (SIGKILL, power loss, OOM killer) records nothing: its row keeps
``end_kind`` NULL. Its progress file (:mod:`~ciuic.chain.progress`) says that it died and where:
the next run on the same machine records both (``Catalog.stopped_at``), and ``ciuic log`` reads
the file until then. Without either, how the run ended is not known.

Where a run stopped is its last ``step()`` (:func:`stopped_where`), in every message.

Imports no SQLAlchemy: ``ciuic log`` reads the runs without the catalog's ORM
(:mod:`ciuic.chain.listing`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from ciuic.chain import progress
from ciuic.format.info import SnapshotInfo
from ciuic.format.manifest import parse_time
from ciuic.format.records import EventRow, RunRow


def was_interrupted(run: RunRow | None) -> bool:
    """Whether a previous run ended other than by finishing (close() or a normal exit): also
    a run that ``ciuic run`` saw fail (its cause), such as an exit with status 3 after a clean
    close()."""
    return run is not None and _interrupted(run.end_kind, run.cause)


def _interrupted(end_kind: str | None, cause: str | None) -> bool:
    return end_kind not in ("clean", "exit") or bool(cause)


def describe_end(run: RunRow, known: bool = True) -> str:
    """How ``run`` ended, as a clause ("it raised ValueError"); the supervisor's cause when
    ``ciuic run`` saw it ("hang: no step() for 600 s ..."). A run that recorded no end died when
    ``known`` (its progress file, or the next run that read it, says so); else how it ended is
    not known."""
    return run.cause or _describe_kind(run.end_kind, known)


def _describe_kind(kind: str | None, known: bool) -> str:
    if kind is None:
        return ("it was killed or crashed: no clean exit was recorded" if known else
                "its end is not known: none was recorded (it was killed or crashed, or could "
                "not write to its catalog)")
    if kind.startswith("signal:"):
        return f"it was stopped by {kind.split(':', 1)[1]}"
    if kind.startswith("exception:"):
        return f"it raised {kind.split(':', 1)[1]}"
    if kind.startswith("exit:"):
        return f"it exited with status {kind.split(':', 1)[1]}"
    return "it exited cleanly"


def stopped_where(step: int | None, exact: bool) -> str:
    """Where a run stopped, in the words of every message: "at step N", N its last ``step()``;
    "after step N" where only a lower bound is known (progress the catalog recorded now and
    then, the latest snapshot); "before its first step()"."""
    if step is None:
        return "before its first step()" if exact else "at an unknown step"
    return f"{'at' if exact else 'after'} step {step}"


def failure_history(every: Sequence[RunRow], current: str) -> tuple[int, float]:
    """(interruptions, seconds of training) of a job's runs other than ``current``: what
    ``save_interval="auto"`` estimates the job's failure rate from. A run that may still be
    running is not counted."""
    failures, seconds = 0, 0.0
    for run in every:
        if run.id == current or may_still_run(run):
            continue
        try:
            span = (parse_time(run.ended or run.last_seen) - parse_time(run.started))
        except ValueError:
            continue
        seconds += max(0.0, span.total_seconds())
        failures += was_interrupted(run)
    return failures, seconds


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def may_still_run(run: RunRow | None, recent_s: float = 30.0) -> bool:
    """Whether a previous run that recorded no end may still be alive: its process exists on
    this machine, or (elsewhere) it reported progress within ``recent_s`` seconds."""
    if run is None or run.end_kind is not None:
        return False
    if run.host == socket.gethostname():
        return pid_alive(run.pid)
    try:
        seen = parse_time(run.last_seen).timestamp()
    except ValueError:
        return False
    return time.time() - seen < recent_s


def identity() -> dict[str, str]:
    """Who we are, precisely enough to tell that a pid on "this machine" is ours to check:
    hostname, boot ID and PID namespace (containers may share a hostname, not the latter)."""
    ident = {"host": socket.gethostname(), "boot": "", "pidns": ""}
    try:
        ident["boot"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ident["pidns"] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return ident


IDENTITY = identity()


def history(runs: Sequence[RunRow], events: Sequence[EventRow],
            snapshots: Sequence[SnapshotInfo] | None = None, *,
            listed_pruned: bool = False) -> dict[str, list[str]]:
    """What happened around each snapshot (ID -> notes, in time order): where a run that did
    not finish stopped after it (and why), and which runs resumed from it.

    Given the job's ``snapshots`` (every one, pruned too), the note of where a run stopped goes
    on the latest snapshot of its lineage at or before that step, committed before the next
    run started, that the listing shows (committed ones; pruned ones too with
    ``listed_pruned``): also one whose event the catalog lacks (the run was killed between the
    commit and its event). Where retention pruned every such one, on the nearest listed one
    before it, else on the first listed one after it ("before this, run R stopped ..."), so
    that the listing shows every interruption. Without ``snapshots``, on the run's last
    recorded snapshot (or the one it resumed from)."""
    # each event once: a server used to add again the events a report sent again (issue 30)
    events = list(dict.fromkeys(events))
    found: dict[str, list[tuple[str, str]]] = {}  # snapshot -> (time, note)
    last: dict[str, str] = {}  # run -> the last snapshot it committed, or resumed from
    restarts = {r.id: r.restart for r in runs if r.restart}
    skipped: dict[str, list[str]] = {}  # run -> the damaged snapshots its restore skipped
    failed: dict[tuple[str, str], list[EventRow]] = {}  # (run, its snapshot before) -> those
    for e in sorted(events, key=lambda e: (e.at, e.kind != "restore")):
        if e.kind == "failed":
            failed.setdefault((e.run, last.get(e.run, "")), []).append(e)
        if e.kind in ("snapshot", "restore") and e.detail:
            last[e.run] = e.detail
        if e.kind == "damaged":
            sid, _, why = e.detail.partition(": ")
            skipped.setdefault(e.run, []).append(f"step {e.step} ({sid[:8]}) was damaged: "
                                                 f"{_short(why)}")
            found.setdefault(sid, []).append((e.at, f"damaged: {_short(why)} (found by run "
                                                    f"{e.run[:8]}'s restore, which skipped it)"))
        if e.kind == "restore" and e.detail:
            by = f" (restart {restarts[e.run]} by ciuic run)" if e.run in restarts else ""
            why = "".join(f"; {x}" for x in skipped.pop(e.run, []))
            found.setdefault(e.detail, []).append((e.at, f"resumed by run {e.run[:8]}{by}{why}"))
    died = {e.run for e in events if e.kind == "stopped"}  # Catalog.stopped_at
    chain = _Chain(snapshots or (), listed_pruned)
    for (run, sid), those in failed.items():
        s = chain.by_id.get(sid)
        if snapshots and (s is None or not chain.listed(s)):
            sid = ""  # (before any snapshot, or after one the listing leaves out)
        found.setdefault(sid, []).append((those[0].at, failures_said(run, those, bool(sid))))
    starts = sorted(r.started for r in runs)
    for r in runs:
        where = last.get(r.id)
        if where is None:
            continue
        # a run of this machine that recorded no end, before the next run takes its progress
        # file: it died there, or its end is in the file (the catalog could not record it)
        stop = local_stop(r)
        kind = r.end_kind or (stop.end if stop is not None else None)
        if not _interrupted(kind, r.cause):
            continue
        when = r.ended or r.last_seen
        following = next((t for t in starts if t > r.started), None)  # the next run's start
        if kind is None and may_still_run(r):
            at, _, _ = chain.place(where, r.started, following, None)
            found.setdefault(at, []).append((when, f"run {r.id[:8]} may still be running"))
            continue
        step, known = r.last_step, kind is not None or r.id in died or bool(r.cause)
        if stop is not None:
            known = True
            step = max((x for x in (step, stop.step) if x is not None), default=None)
        at, after, reached = chain.place(where, r.started, following, step if known else None)
        if not known and reached is not None:  # a lower bound: the later of the two
            step = reached if step is None else max(step, reached)
        how = r.cause or _describe_kind(kind, known)
        found.setdefault(at, []).append(
            (when, f"{'before this, run' if after else 'then run'} {r.id[:8]} stopped "
                   f"{stopped_where(step, known)}: {how.removeprefix('it ')}"))
    return {sid: [note for _, note in sorted(notes)] for sid, notes in found.items()}


def failures_said(run: str, those: Sequence[EventRow], then: bool) -> str:
    """A run's failed snapshots (its "failed" events, in order) in one note: after the
    snapshot it is shown on (``then``), or on its own."""
    steps = sorted({e.step for e in those if e.step is not None})
    why = _short(those[-1].detail)
    if len({e.detail for e in those}) > 1:
        why = f"the last: {why}"
    said = (f"run {run[:8]}'s snapshot at step {steps[0]} failed" if len(those) == 1 and steps
            else f"{len(those)} snapshots of run {run[:8]} failed"
            + (f", at steps {steps[0]} to {steps[-1]}" if steps else ""))
    return f"{'then ' if then else ''}{said}: {why}"


def damaged(events: Sequence[EventRow]) -> set[str]:
    """The snapshots a restore found damaged and skipped (a "damaged" event), by ID."""
    return {e.detail.partition(": ")[0] for e in events if e.kind == "damaged"}


def _short(why: str, most: int = 200) -> str:
    """A restore's reason in one line of at most ``most`` characters."""
    line = " ".join(why.split())
    return line if len(line) <= most else line[:most - 3] + "..."


class _Chain:
    """A job's snapshots, for :func:`history` to place a note of where a run stopped."""

    def __init__(self, snapshots: Sequence[SnapshotInfo], listed_pruned: bool) -> None:
        self.by_id = {s.id: s for s in snapshots}
        self.children: dict[str, list[SnapshotInfo]] = {}
        for s in snapshots:
            if s.parent:
                self.children.setdefault(s.parent, []).append(s)
        self.listed_pruned = listed_pruned

    def listed(self, s: SnapshotInfo) -> bool:
        return self.listed_pruned or s.status == "committed"

    def after(self, s: SnapshotInfo) -> list[SnapshotInfo]:
        """Every snapshot of ``s``'s lineage after it."""
        out, todo = [], list(self.children.get(s.id, ()))
        while todo:
            c = todo.pop()
            out.append(c)
            todo.extend(self.children.get(c.id, ()))
        return out

    def place(self, where: str, started: str, following: str | None, step: int | None
              ) -> tuple[str, bool, int | None]:
        """Where the note of a run goes that last recorded snapshot ``where`` (committed, or
        resumed from), started at ``started``, followed by a run that started at
        ``following``, stopped at ``step`` (None: not known exactly): the snapshot's ID,
        whether it comes after the stop, and the step of the run's latest snapshot."""
        first = self.by_id.get(where)
        if first is None:
            return where, False, None
        own = [first, *(s for s in self.after(first) if started <= s.created
                        and (following is None or s.created < following)
                        and (step is None or s.step <= step))]
        reached = max(own, key=lambda s: s.seq).step
        shown = [s for s in own if self.listed(s)]
        if shown:
            return max(shown, key=lambda s: s.seq).id, False, reached
        s = first
        while s.parent in self.by_id:  # retention kept an older one (keep_every)
            s = self.by_id[s.parent]
            if self.listed(s):
                return s.id, False, reached
        later = [s for s in self.after(first) if self.listed(s)]
        if later:  # keep_last: the oldest one listed
            return min(later, key=lambda s: s.seq).id, True, reached
        return where, False, reached


def local_stop(run: RunRow) -> progress.Stop | None:
    """What the progress file of a run that recorded no end says, when the run was of this
    machine and no later run has taken the file yet."""
    if run.end_kind is not None or run.host != socket.gethostname():
        return None
    return progress.peek(run.id)
