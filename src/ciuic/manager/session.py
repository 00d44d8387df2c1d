"""The run session: the repository a manager writes to, its run's record in the catalog (start,
progress heartbeats, events, how it ended), the job's lease, and the bookkeeping after each
commit (events, retention).

Multi-rank, rank 0 alone keeps the catalog, the lease and the mirror; the other ranks learn the
run's ID and whether the previous run was interrupted from it, and a failure there stops every
rank.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import shlex
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType
from typing import Any, NoReturn

from ciuic import knobs
from ciuic.chain import progress, runs
from ciuic.chain.gc import collect
from ciuic.chain.lease import Lease
from ciuic.chain.lease import acquire as acquire_lease
from ciuic.chain.repo import Repository, cached_catalog_url
from ciuic.chain.retention import prune
from ciuic.chain.transfer import copy_job
from ciuic.distributed.collective import Collective
from ciuic.distributed.save import check_shared_store
from ciuic.errors import RankError
from ciuic.format.manifest import utc_now
from ciuic.format.records import RunRow
from ciuic.manager import supervised as asking
from ciuic.manager.config import ManagerConfig
from ciuic.manager.report import RunReporter
from ciuic.manager.supervised import NOT_KNOWN_YET, PendingCause, Restart, Supervised, attach
from ciuic.store.mirror import MirrorStore
from ciuic.words import counted

log = logging.getLogger("ciuic")


_warned: set[str] = set()



def warn_once(message: str) -> None:
    """A warning about the configuration, once per process (not once per manager)."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)



def ensure_log_handler() -> None:
    """Show ciuic's INFO lines (the recovery log) when the application configured no logging."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    handler.set_name("ciuic")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False



def quiet_other_ranks(rank: int) -> None:
    """Multi-rank: rank 0 alone prints the recovery log; the others print warnings and errors,
    marked with their rank (only through the handler ciuic installed itself)."""
    for handler in log.handlers:
        if handler.get_name() == "ciuic" and rank != 0:
            handler.setLevel(logging.WARNING)
            handler.setFormatter(logging.Formatter(f"[%(levelname)s rank {rank}] %(message)s"))


def quietly(what: str, fn: Callable[..., Any], *args: Any) -> None:
    """Run bookkeeping that must never stop training or fail a committed snapshot."""
    try:
        fn(*args)
    except Exception as e:
        log.warning("could not %s (training and snapshots go on): %s", what, e)


class RunSession:
    """One process's run of a job (see the module's docstring)."""

    def __init__(self, config: ManagerConfig, coll: Collective) -> None:
        """Open the repository (every rank); :meth:`start` then records the run."""
        self.config = config
        self.coll = coll
        self.project, self.job = config.project, config.job
        self._reporter: RunReporter | None = None  # rank 0 of a job on a server
        coll.run("opening the store", self._open_repo)
        self.run_id = secrets.token_hex(8)
        self.previous_run: RunRow | None = None
        self.interrupted = False
        self.lease: Lease | None = None
        #: whether where and how the previous run ended is known: it recorded its end, or it
        #: died and its progress file on this machine (chain.progress) or ``ciuic run`` says so
        self.previous_known = False
        #: what the other ranks' ``ciuic run`` (other nodes') said about the previous start
        self._said_elsewhere: list[Restart] = []
        #: a restart whose cause ``ciuic run`` named after this run started (rank 0 asks)
        self._pending: PendingCause | None = None
        #: this run's last step() (where it stopped, when it stops: chain.runs.stopped_where)
        self.last_step: int | None = None
        self._progress: progress.Progress | None = None
        self._last_heartbeat = 0.0
        self._ended: str | None = None  # the end record_end() was first given
        self._unwritable = False  # the catalog could not be written, and that was said
        #: the damaged objects retention's gc last warned of (once a run, not once a snapshot)
        self._damage_said: list[str] = []
        self._probe_due = False  # the store's write speed is measured from the first step()
        #: under ``ciuic run``: the heartbeats, the host-memory tier, the previous start's cause
        self.supervised: Supervised | None = attach()

    def start(self) -> None:
        """Record the run, take the lease, catch the mirror up (rank 0, which shares the run's
        ID and whether the previous run was interrupted with every rank)."""
        coll = self.coll
        if not coll.enabled:
            self._start()
        else:
            error = None
            # each node's ciuic run says why the previous generation stopped; rank 0's node may
            # be a new one whose ciuic run knows nothing (a lost node's replacement)
            sup = self.supervised
            words = coll.all_gather(None if sup is None or sup.restart is None
                                    else sup.restart.to_json())
            self._said_elsewhere = [r for r in map(Restart.from_json, words) if r is not None]
            if coll.coordinator:
                try:
                    self._start()
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
            shared = coll.broadcast([self.run_id, self.interrupted, error])
            self.run_id, self.interrupted = shared[0], shared[1]
            if shared[2]:
                raise RankError("starting the run", {0: str(shared[2])})
            check_shared_store(coll, self.repo.store, self.run_id)
        self._warn_if_taken_over()
        _track(self)

    def _open_repo(self) -> None:
        c = self.config
        if c.endpoint is not None:  # a ciuic server: this project's objects over HTTP
            from ciuic.store.http import HttpStore

            server = HttpStore(c.endpoint, self.project, c.api_key)
            self.repo = Repository.open(server, cached_catalog_url(server.url), mirror=c.mirror,
                                        durability=c.durability)
            if self.coll.coordinator:
                self._reporter = RunReporter(server, self.repo.catalog, self.job)
        else:
            self.repo = Repository.open(c.store, mirror=c.mirror, durability=c.durability,
                                        writable=True)
            if c.api_key is not None:
                warn_once(f"api_key= is the key of a ciuic server, and no server is configured "
                          f"(endpoint= or CIUIC_ENDPOINT): the key is not used, and the "
                          f"snapshots go to the store {self.repo.name}")

    def _start(self) -> None:
        """Rank 0 (or the single process): index the job, record the run, take the lease,
        catch the mirror up."""
        self.repo.sync_job(self.project, self.job)
        prev = self.previous_run = self.repo.catalog.start_run(self.project, self.job,
                                                               self.run_id)
        self.interrupted = runs.was_interrupted(prev)
        if prev is not None:
            self.previous_run = self._how_previous_ended(prev)
        self._progress = progress.Progress(self.run_id)
        if self._reporter is not None:
            if prev is not None:  # what this run learnt of how the previous one ended
                self._reporter.report(prev.id)
            self._reporter.report(self.run_id)
        self.lease = acquire_lease(self.repo.store, self.project, self.job, self.run_id)
        self._catch_up_mirror()

    def _how_previous_ended(self, prev: RunRow) -> RunRow:
        """Learn where the previous run stopped and how, from its end record, its progress file
        on this machine and ``ciuic run``; record in the catalog what it could not (for ``ciuic
        log`` and the dashboard). The previous run with what was learnt."""
        stop = None
        if prev.host == socket.gethostname() and not _still_running(prev):
            stop = progress.take(prev.id)
        if prev.end_kind is None and stop is not None and stop.end is not None:
            prev = self._record_late_end(prev, stop)
        self.previous_known = prev.end_kind is not None
        died = prev.end_kind is None and stop is not None
        steps = [prev.last_step, stop.step if stop is not None else None]
        said = self._supervisor_said(prev, steps)
        if said is not None:
            prev = said
            died = died or prev.end_kind is None
        if died:  # its last step() is known: the later of its file's and the supervisor's
            prev = replace(prev, last_step=max((x for x in steps if x is not None), default=None))
            self.repo.catalog.stopped_at(prev.id, prev.last_step)
            self.previous_known = True
        self.interrupted = runs.was_interrupted(prev)
        return prev

    def _record_late_end(self, prev: RunRow, stop: progress.Stop) -> RunRow:
        """The previous run ended, and its catalog could not record that (a full disk): its
        progress file kept the end, recorded now. The previous run with its end."""
        assert stop.end is not None
        at = utc_now(stop.ended) if stop.ended else None
        self.repo.catalog.end_run(prev.id, stop.end, stop.step, at)
        prev = replace(prev, end_kind=stop.end, ended=at or utc_now(),
                       last_step=prev.last_step if stop.step is None else stop.step)
        log.info("The previous run (%s) ended %s, %s; its catalog could not record that then, "
                 "its progress file kept it: recorded now", prev.id,
                 runs.stopped_where(prev.last_step, exact=True),
                 runs.describe_end(prev).removeprefix("it "))
        return prev

    def _supervisor_said(self, prev: RunRow, steps: list[int | None]) -> RunRow | None:
        """Under ``ciuic run``, after a restart: record why the previous start stopped (the
        supervisor saw it), and this run's restart number; add its last step() to ``steps``.
        ``prev`` with the supervisor's cause, when the supervisor saw it stop; else None."""
        sup = self.supervised
        restart = sup.restart if sup is not None else None
        if restart is None or not restart.cause:
            # another node's word on the start the previous run was part of, where this node's
            # ciuic run has none (it is new, or it had no cause yet)
            restart = next((r for r in self._said_elsewhere if r.cause and prev.pid in r.pids),
                           restart)
        if restart is None:
            return None
        self.repo.catalog.restarted(self.run_id, restart.number)
        if restart.pids and prev.pid not in restart.pids:
            return None  # the previous start never reached its manager: prev is an older run
        steps.append(restart.stopped_at)
        if restart.cause:
            self.repo.catalog.interrupted_by(prev.id, restart.cause)
            prev = replace(prev, cause=restart.cause)
        else:  # not its own exception (a lost connection, a consequence): asked again
            self._pending = PendingCause(prev.id, restart.number, time.monotonic())
            prev = replace(prev, cause=NOT_KNOWN_YET)
        self.interrupted = True
        return prev

    def _ask_cause(self, now: float) -> None:
        """Rank 0, while :attr:`_pending`: ask ``ciuic run`` for the cause it did not know at
        the start; record it and say it once named."""
        assert self._pending is not None and self.supervised is not None
        cause = self._pending.ask(self.supervised, now)
        if cause is None:
            return
        run_id, self._pending = self._pending.run_id, None
        prev = self.previous_run
        where = runs.stopped_where(prev.last_step if prev is not None else None, exact=True)
        if not cause:
            log.info("The cause of the interruption %s is still not known: ciuic run named "
                     "none (its log says what it saw)", where)
            return
        self._record("the cause of the previous run's end", self.repo.catalog.interrupted_by,
                     run_id, cause)
        if prev is not None:
            self.previous_run = replace(prev, cause=cause)
        log.info("The cause of the interruption %s, named by ciuic run after this run started: "
                 "%s", where, cause)

    def _warn_if_taken_over(self) -> None:
        prev, lease = self.previous_run, self.lease
        if prev is not None and lease is not None and _still_running(prev):
            log.warning(
                "job %s/%s may still be running in another process (pid %s on %s, run %s, last "
                "seen %s). This process takes the job over (lease %d): the other one can no "
                "longer commit snapshots and will say so. Stop it if it is still running.",
                self.project, self.job, prev.pid, prev.host, prev.id, prev.last_seen,
                lease.token)

    def _catch_up_mirror(self) -> None:
        """On a mirror, send in the background what an earlier run left unmirrored."""
        mirror = self.repo.store
        if not isinstance(mirror, MirrorStore) or mirror.durability != "local":
            return
        fast = Repository(mirror.fast, self.repo.catalog)

        def catch_up() -> None:
            try:
                stats = copy_job(fast, mirror.remote, self.project, self.job, verify=False)
            except Exception as e:  # never fatal: the next run tries again
                log.warning("catching up the mirror %s failed: %s", mirror.remote.url, e)
                return
            if stats.sent:
                log.info("mirror %s caught up: %s, %s sent", mirror.remote.url,
                         counted(stats.snapshots, "snapshot"), counted(stats.sent, "object"))

        mirror.submit(catch_up)

    def probe_write_speed(self) -> None:
        """Measure the store's write speed in the background (rank 0 only: not 256 MiB more
        per rank on a shared file system), so that no snapshot waits for it: from the run's
        first :meth:`heartbeat` (its first ``step()``), not now. A restore comes first, and on
        a local disk the probe (256 MiB written, fsync'ed, dropped from the page cache and read
        back) competed with its reads: a cold restore of 1 GiB read in 1.07 s with the probe
        started here, 0.88 s with it started at the first step (bench/resume.py, medians of 6
        interleaved rounds, each round faster). A snapshot that needs the speed before any
        step() (a ``save()`` right away) measures it itself (``write_speed()``), as it waits
        for a probe still running."""
        self._probe_due = True

    def _start_probe(self) -> None:
        self._probe_due = False
        threading.Thread(target=quietly, name="ciuic-probe", daemon=True,
                         args=("measure the store's write speed",
                               self.repo.store.write_speed)).start()

    # -- records ---------------------------------------------------------------------------

    def heartbeat(self, step: int, now: float) -> None:
        """Record progress (rank 0), so that the next run knows where this one got to: every
        step in the progress file, now and then in the catalog."""
        self.last_step = step
        if self._probe_due:
            self._start_probe()
        if _exit_status is not None:  # a sys.exit() that did not end the process: caught
            _exit_called(None)
        if self._progress is not None:
            self._progress.set(step)
        if self.supervised is not None:
            self.supervised.beacon.step(step)
            if self._pending is not None and self.coll.coordinator:
                self._ask_cause(now)
        if self.coll.coordinator and now - self._last_heartbeat >= knobs.get(
                ).heartbeat_interval_s:
            self._last_heartbeat = now
            self._record(f"the run's progress (step {step})", self.repo.catalog.heartbeat,
                         self.run_id, step)
            if self._reporter is not None:
                self._reporter.report(self.run_id)

    def warn_if_not_resuming(self, step: int) -> None:
        """At the first ``step()`` of a run that did not call ``restore()``: warn when the job
        already has snapshots (this run is not resuming from them)."""
        latest = self.repo.catalog.latest(self.project, self.job)
        if latest is None:
            return
        prev = self.previous_run
        how = ("the previous run was interrupted: " + runs.describe_end(prev, self.previous_known)
               if self.interrupted and prev is not None else "")
        log.warning(
            "!!! job %s/%s already has snapshots (latest at step %d, %s) but this run did not "
            "call restore(): it is NOT resuming. It trains from step %d and its snapshots start "
            "a new lineage; the old ones are kept. %s To resume, call "
            "manager.restore(model, optimizer) before the loop.",
            self.project, self.job, latest.step, latest.created[:19] + "Z", step,
            (how + ".") if how else "",
        )

    def event(self, kind: str, step: int, detail: str) -> None:
        """Record an event of the run (rank 0): ``detail`` is the snapshot's ID, or what
        happened."""
        if self.coll.coordinator:
            self._record(f"the {kind} event of step {step}", self.repo.catalog.event, self.run_id,
                         self.project, self.job, kind, step, detail)
            if self._reporter is not None:
                self._reporter.report(self.run_id)

    def failed(self, step: int, e: Exception) -> None:
        """After a snapshot failed: tell the supervisor (every rank); record it with its
        reason (rank 0), for ``ciuic log``."""
        if self.supervised is not None:
            self.supervised.beacon.failed(step)
        self.event("failed", step, " ".join((str(e) or type(e).__name__).split())[:500])

    def committed(self, step: int, snapshot_id: str) -> None:
        """After a commit: tell the supervisor (every rank); record it, then prune what
        retention no longer keeps (rank 0)."""
        if self.supervised is not None:
            self.supervised.beacon.committed(step)
        if not self.coll.coordinator:
            return
        self.event("snapshot", step, snapshot_id)
        if self.config.retains:
            quietly("apply retention", self._apply_retention, snapshot_id)

    def _apply_retention(self, current: str) -> None:
        pruned = prune(self.repo, self.project, self.job, self.config.keep_last,
                       self.config.keep_every, protect=[current])
        if pruned:
            result = collect(self.repo)  # skips when a save is in flight or data is damaged
            log.debug("retention pruned %s; gc deleted %s %s", counted(len(pruned), "snapshot"),
                      counted(result.deleted_chunks, "chunk"), result.skipped)
            if result.damaged and result.damaged != self._damage_said:
                log.warning("retention's gc in %s: %s", self.repo.name, result.warning(
                    f"ciuic --store {shlex.quote(self.repo.name)} gc --quarantine"))
            self._damage_said = result.damaged or self._damage_said

    def _record(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Write ``what`` to the catalog (rank 0). A failure is logged and training goes on; a
        catalog that cannot be written at all (its disk full) is said once, in ciuic's words,
        until a write succeeds again."""
        try:
            fn(*args)
        except Exception as e:
            failure = self.repo.catalog.write_failure(e)
            if failure is None:
                log.warning("could not record %s (training and snapshots go on): %s", what, e)
            elif not self._unwritable:
                self._unwritable = True
                log.warning("%s. %s is not recorded there, nor what follows until it can be "
                            "written; training and snapshots go on. %s.", failure[0],
                            what[:1].upper() + what[1:], failure[1])
            return
        self._unwritable = False

    def record_end(self, kind: str) -> None:
        """How the run ended (``clean``, ``exit``, ``exit:STATUS``, ``exception:T``,
        ``signal:NAME``), at its last step(); the first record wins."""
        _untrack(self)
        if self.supervised is not None and kind == "clean":
            self.supervised.beacon.detach()  # done training: no longer watched for a hang
        if self._ended is not None:
            return
        self._ended = kind
        recorded = not self.coll.coordinator or self._record_end(kind)
        if self._progress is not None:  # kept after a crash, or an end not recorded: the next
            self._progress.close(remove=recorded and kind in ("clean", "exit"))  # run reads it
            self._progress = None
        if self._reporter is not None:
            self._reporter.report_now(self.run_id)

    def record_exit(self, tp: type[BaseException] | None, value: BaseException | None) -> None:
        """A ``with`` block left by an exception, or by ``sys.exit(N)`` with N other than 0,
        records that end (anything else ends at ``close()``)."""
        if tp is not None and not issubclass(tp, SystemExit):
            self.record_end(f"exception:{tp.__name__}")
        elif isinstance(value, SystemExit) and exit_status(value.code):
            self.record_end(f"exit:{exit_status(value.code)}")

    def _record_end(self, kind: str) -> bool:
        """Record the end in the catalog; where that fails, keep it in the progress file for
        the next run of the job on this machine. Whether the catalog has it."""
        try:
            self.repo.catalog.end_run(self.run_id, kind, self.last_step)
            return True
        except Exception as e:
            kept = self._progress.ended(kind) if self._progress is not None else None
            failure = self.repo.catalog.write_failure(e)
            if failure is None:  # the catalog may be gone at interpreter exit
                log.debug("could not record the end of run %s: %s", self.run_id, e)
                return False
            log.warning("%s. The end of run %s (%s, %s) is not recorded there; %s. %s.",
                        failure[0], self.run_id, kind,
                        runs.stopped_where(self.last_step, exact=True),
                        f"it is kept in {kept} for the next run of this job on this machine to "
                        "record" if kept is not None else "`ciuic log` will say that how the "
                        "run ended is not known", failure[1])
            return False

    def close(self, abandoned: bool = False) -> None:
        """``abandoned``: in-process recovery (:mod:`ciuic.supervisor.inprocess`); the cause of the
        previous restart is not waited for."""
        if self.supervised is not None:
            if self._pending is not None and self.coll.coordinator and not abandoned:
                self._last_ask()
            self.supervised.close()
        self.repo.close()

    def _last_ask(self) -> None:
        """Rank 0 closes while the cause of its restart is still not named: a run that ends
        a few steps after a restart may end before its ``ciuic run`` has another node's word
        (it waits for a hang's timeout, a lost node's keep-alive). Wait a little for it
        (``CAUSE_AT_CLOSE_S``), asking as ``step()`` does, so that the catalog still
        records why the previous run ended."""
        end = time.monotonic() + asking.CAUSE_AT_CLOSE_S
        while self._pending is not None:
            self._pending.next_ask = 0.0
            now = time.monotonic()
            self._ask_cause(now)
            if self._pending is None or now >= end:
                break
            time.sleep(asking.CAUSE_ASK_CLOSING_EVERY_S)
        if self._pending is not None:
            prev = self.previous_run
            log.info("The cause of the interruption %s is still not known at this run's end "
                     "(ciuic run's log says what it saw)", runs.stopped_where(
                         prev.last_step if prev is not None else None, exact=True))
            self._pending = None


# -- uncaught exceptions and interpreter exit end every live session's run --------------------

_live: weakref.WeakSet[RunSession] = weakref.WeakSet()
_prev_excepthook: Callable[..., Any] | None = None
_sys_exit: Callable[..., Any] | None = None  # the sys.exit that _tracked_exit wraps
#: the status the main thread last called sys.exit() with, while no step() came after it
_exit_status: int | None = None


def exit_status(code: object) -> int:
    """The process's exit status for ``SystemExit(code)``, as Python computes it: None is 0,
    an int itself, anything else (a message, printed) 1."""
    return 0 if code is None else code if isinstance(code, int) else 1


def _exit_called(status: int | None) -> None:
    global _exit_status
    _exit_status = status


def _tracked_exit(status: object = None) -> NoReturn:
    """``sys.exit`` while a manager is live: keep the status for the end recorded at exit.
    atexit handlers are not told it, and SystemExit reaches no hook; a run that is not closed
    (the seed-style loop: no ``with``, no close()) would end 'exit', a clean end, for any
    status. Another thread's sys.exit ends that thread only: not kept."""
    if threading.current_thread() is threading.main_thread():
        _exit_called(exit_status(status))
    assert _sys_exit is not None
    _sys_exit(status)
    raise SystemExit(status)  # not reached: for the type checker


def _excepthook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if not issubclass(tp, SystemExit):
        for s in list(_live):
            s.record_end(f"exception:{tp.__name__}")
    hook = _prev_excepthook or sys.__excepthook__
    hook(tp, value, tb)


def _at_exit() -> None:
    """A run not closed ends with the process: 'exit' (status 0, or not known: the script's
    normal end, ``raise SystemExit(N)``), 'exit:N' after ``sys.exit(N)``."""
    kind = f"exit:{_exit_status}" if _exit_status else "exit"
    for s in list(_live):
        s.record_end(kind)


def _track(session: RunSession) -> None:
    """Record ``session``'s run end on uncaught exceptions and at interpreter exit (with the
    status of a ``sys.exit``)."""
    global _prev_excepthook, _sys_exit
    if _prev_excepthook is None:
        _prev_excepthook = sys.excepthook
        sys.excepthook = _excepthook
        _sys_exit, sys.exit = sys.exit, _tracked_exit
        atexit.register(_at_exit)
    _live.add(session)


def _untrack(session: RunSession) -> None:
    _live.discard(session)


def _still_running(run: RunRow) -> bool:
    """Whether a run that recorded no end may still be running: in another process
    (``runs.may_still_run``), or in this one (its manager not closed yet)."""
    if run.end_kind is None and run.host == socket.gethostname() and run.pid == os.getpid():
        return any(s.run_id == run.id for s in _live)
    return runs.may_still_run(run)


__all__ = ["RunSession", "ensure_log_handler", "quiet_other_ranks", "quietly", "warn_once"]
