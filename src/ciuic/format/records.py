"""The catalog's rows of jobs, runs and run events, as the catalog (:mod:`ciuic.catalog`, through
SQLAlchemy) and ``ciuic ls``/``ciuic log``'s fast path (:mod:`ciuic.chain.listing`, through
``sqlite3``) both return them, and a run's report to a server; each with its JSON shape, where
it has one (the server's API). A snapshot's row is :class:`ciuic.format.info.SnapshotInfo`.

Here, below both readers, so that the fast path imports neither SQLAlchemy nor the catalog.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class JobRow:
    """A job with its committed snapshots' count, latest step and new bytes, and when its
    latest snapshot (of any status) was taken: a row of ``ciuic ls``."""

    project: str
    job: str
    snapshots: int
    max_step: int | None  # None: no committed snapshot
    new_bytes: int
    latest: str | None  # None: no snapshot

    def to_json(self) -> dict[str, Any]:
        """The server's shape (``GET /v1/projects/P/jobs``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class RunFields:
    """What the catalog's row of a run says of it, besides its ID and its job: what a client
    reports of a run to its server (:class:`RunReport`)."""

    started: str
    host: str
    pid: int
    last_step: int | None
    last_seen: str
    ended: str | None
    # clean | exit | exit:<status> | exception:<Type> | signal:<NAME>; None while it runs (or
    # after a kill)
    end_kind: str | None
    # why it stopped, as ``ciuic run`` saw it ("hang: no step() for 600 s ..."); else None
    cause: str | None
    # the restart number ``ciuic run`` gave it (None: not started by it, or its first start)
    restart: int | None

    def to_json(self) -> dict[str, Any]:
        """These fields alone (a :class:`RunRow`'s too: its ID and job are the catalog's)."""
        return {name: getattr(self, name) for name in RUN_FIELDS}

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> RunFields:
        return RunFields(**{name: obj[name] for name in RUN_FIELDS})


#: the fields of a run that a client reports, in their order
RUN_FIELDS = tuple(f.name for f in fields(RunFields))


@dataclass(frozen=True)
class RunRow(RunFields):
    """A row of the catalog's ``runs`` table: one process's run of a job (how it ended tells
    the next run what happened)."""

    id: str
    job_id: int  # the catalog's own key of the job


@dataclass(frozen=True)
class EventRow:
    """A row of the catalog's ``run_events`` table: something a run did or learnt ("start",
    "snapshot", "restore", "end", "stopped", "interrupted", ...), at a time and step."""

    run: str
    at: str
    kind: str
    step: int | None
    detail: str  # a snapshot's ID for "snapshot" and "restore"; else words

    def to_json(self) -> dict[str, Any]:
        """As a run's report holds it (the report names the run)."""
        return {"at": self.at, "kind": self.kind, "step": self.step, "detail": self.detail}

    @classmethod
    def from_json(cls, run: str, obj: Mapping[str, Any]) -> EventRow:
        return cls(run=run, at=obj["at"], kind=obj["kind"], step=obj["step"],
                   detail=obj["detail"])


@dataclass(frozen=True)
class RunReport:
    """A run as a client's own catalog holds it, and its events after the last report: what the
    client sends its server (``PUT /v1/projects/P/jobs/J/runs/RUN``, :mod:`ciuic.manager.report`)
    and the server records (``Catalog.record_run``)."""

    run: RunFields
    events: tuple[EventRow, ...]

    def to_json(self) -> dict[str, Any]:
        """The request's body: the run's fields and ``events``."""
        return {**self.run.to_json(), "events": [e.to_json() for e in self.events]}

    @classmethod
    def from_json(cls, run_id: str, obj: Mapping[str, Any]) -> RunReport:
        """The report of run ``run_id`` (the request's path names it)."""
        return cls(RunFields.from_json(obj),
                   tuple(EventRow.from_json(run_id, e) for e in obj.get("events", ())))
