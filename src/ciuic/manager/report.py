"""Runs reported to a ciuic server: a job that writes to a server keeps its runs (how each
ended, its events, the cause ``ciuic run`` saw) in its own catalog, which is a local cache; so
that the server's ``ciuic log`` and dashboard can say where each run stopped and why, rank 0
sends each run's record and its new events to the server (``PUT
/v1/projects/P/jobs/J/runs/RUN``).

Sends run on a background thread (training never waits for the server), coalesced per run; the
end of a run is sent on the caller's thread, since the process may exit next. A failure is
logged once and retried with the next report: it never stops training.

A process sends each event of its own run once. The first report of a run in a process sends
all of that run's events: the next run reports the previous one so (what it learnt of how it
ended), since it cannot know what that process got through before it was killed. The server
keeps each event once (``Catalog.record_run``), so a report sent again adds nothing.
"""

from __future__ import annotations

import logging
import queue
import threading

from ciuic.catalog import Catalog
from ciuic.store.http import HttpStore

log = logging.getLogger("ciuic")
_STOP = "\0stop"  # the end of the run: the worker stops
_DRAIN_S = 10.0  # the longest the end of a run waits for a send in flight


class RunReporter:
    """Sends a job's runs to its server (see the module's docstring)."""

    def __init__(self, server: HttpStore, catalog: Catalog, job: str) -> None:
        self._server, self._catalog, self._job = server, catalog, job
        self._sent: dict[str, int] = {}  # run -> the last event ID the server has
        self._lock = threading.Lock()
        self._queue: queue.Queue[str] = queue.Queue()
        self._queued: set[str] = set()
        self._warned = False
        self._worker = threading.Thread(target=self._work, name="ciuic-report", daemon=True)
        self._worker.start()

    def report(self, run_id: str) -> None:
        """Send the run's record and new events soon."""
        with self._lock:
            if run_id in self._queued:
                return
            self._queued.add(run_id)
        self._queue.put(run_id)

    def report_now(self, run_id: str) -> None:
        """Send it on this thread (the end of a run), once the background send in flight, if
        any, is done: the store and the catalog close next, and a send still running on the
        other thread would find them closed."""
        self._queue.put(_STOP)
        self._worker.join(timeout=_DRAIN_S)
        self._send(run_id)

    def _work(self) -> None:
        while True:
            run_id = self._queue.get()
            if run_id is _STOP:
                return
            with self._lock:
                self._queued.discard(run_id)
            self._send(run_id)

    def _send(self, run_id: str) -> None:
        with self._lock:
            after = self._sent.get(run_id, 0)
        try:
            found, last = self._catalog.run_report(run_id, after)
            if found is None:
                return
            self._server.report_run(self._job, run_id, found.to_json())
        except Exception as e:  # the next report sends what this one did not
            if not self._warned:
                self._warned = True
                log.warning("could not send run %s's record to the server (%s); the server's "
                            "log and dashboard miss it until a later report gets through",
                            run_id[:8], e)
            return
        with self._lock:
            self._sent[run_id] = max(self._sent.get(run_id, 0), last)
