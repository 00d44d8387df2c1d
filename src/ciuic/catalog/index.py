"""The catalog's index: :class:`Catalog`, the SQL index of the store (SQLite by default) and
its queries (projects, jobs, snapshots, runs and their events)."""

from __future__ import annotations

import errno
import json
import math
import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, delete, event, func, select
from sqlalchemy.exc import DatabaseError, IntegrityError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from ciuic.catalog.models import SCHEMA_VERSION, Job, Meta, Project, Run, RunEvent, Snapshot
from ciuic.catalog.schema import bring_to_head
from ciuic.errors import AmbiguousReference, ConfigurationError, SnapshotNotFound
from ciuic.format.info import SnapshotInfo, row_values
from ciuic.format.manifest import Manifest, utc_now
from ciuic.format.records import RUN_FIELDS, EventRow, JobRow, RunFields, RunReport, RunRow


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA busy_timeout=30000")  # first: switching to WAL must wait, not fail
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


_SCHEMA_ATTEMPTS = 20
_Row = TypeVar("_Row", Project, Job)


def _insert_or_get(s: Session, row: _Row, query: Any) -> _Row:
    """Insert ``row``, or, when another process or thread inserted the same one first (a
    unique-constraint race: two writers creating one project), return that one."""
    try:
        with s.begin_nested():
            s.add(row)
            s.flush()
        return row
    except IntegrityError:
        found = s.scalar(query)
        if found is None:
            raise
        return found  # type: ignore[no-any-return]


def _is_damage(e: DatabaseError) -> bool:
    """Whether SQLite says the file itself is bad (as opposed to busy or racing)."""
    text = str(getattr(e, "orig", None) or e).lower()
    return any(m in text for m in ("not a database", "malformed", "encrypted", "disk i/o"))


def _unwritable(e: BaseException) -> tuple[str, str] | None:
    """Why a write failed and what to do, when the database cannot be written at all: its disk
    is full, or it is read-only; None for other errors."""
    orig = getattr(e, "orig", None) or e
    text = str(orig).lower()
    if (getattr(orig, "errno", None) == errno.ENOSPC or "database or disk is full" in text
            or "no space left" in text):
        return "the disk that holds it is full", "Free space on that disk"
    if isinstance(e, OperationalError) and "readonly database" in text:
        return "it is read-only", "Make it writable"
    return None


def _json_metrics(metrics: dict[str, Any]) -> str:
    def clean(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return json.dumps({k: clean(v) for k, v in metrics.items()}, sort_keys=True)


class Catalog:
    """Projects, jobs, snapshots and runs, in a SQL database named by a SQLAlchemy URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            path = url.split("///", 1)[1] if "///" in url else ""
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            else:
                kwargs = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
        try:
            self.engine: Engine = create_engine(url, **kwargs)
        except Exception as e:
            raise ConfigurationError(f"cannot open catalog {url!r}: {e}") from e
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        #: set when a damaged SQLite file was moved aside: the caller rebuilds from the store
        self.recreated_from: Path | None = None
        for attempt in range(_SCHEMA_ATTEMPTS):
            try:
                self._init_schema()
                return
            except DatabaseError as e:
                db = Path(url.split("///", 1)[1]) if url.startswith("sqlite:///") else None
                if db is None or not db.exists():
                    raise ConfigurationError(f"catalog {url} cannot be opened: {e}") from e
                if _is_damage(e):
                    break
                # another process is creating the same catalog right now ("database is
                # locked", "table ... already exists"): that is a race, not damage
                if attempt == _SCHEMA_ATTEMPTS - 1:
                    raise ConfigurationError(f"catalog {url} cannot be opened: {e}") from e
                time.sleep(0.05 * (attempt + 1))
        db = Path(url.split("///", 1)[1])  # reached only when SQLite said the file is damaged
        self.engine.dispose()
        aside = db.with_name(f"{db.name}.damaged-{int(time.time())}")
        db.rename(aside)
        for extra in ("-wal", "-shm"):
            Path(str(db) + extra).unlink(missing_ok=True)
        self.recreated_from = aside
        self._init_schema()

    def _init_schema(self) -> None:
        bring_to_head(self.engine, self.url)
        url = self.url
        with self.session() as s:
            row = s.get(Meta, "schema_version")
            if row is None:
                s.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
            elif int(row.value) > SCHEMA_VERSION:
                raise ConfigurationError(
                    f"catalog {url} has schema {row.value}, newer than this ciuic understands "
                    f"({SCHEMA_VERSION}); upgrade ciuic"
                )

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._session.begin() as s:
            yield s

    def close(self) -> None:
        self.engine.dispose()

    @property
    def where(self) -> str:
        """The catalog's file (SQLite), else its URL without the password."""
        if self.url.startswith("sqlite:///"):
            return self.url.split("///", 1)[1]
        return self.engine.url.render_as_string(hide_password=True)

    def write_failure(self, e: BaseException) -> tuple[str, str] | None:
        """A write that raised ``e``, in ciuic's words, when the catalog cannot be written at
        all: ("the catalog PATH cannot be written: the disk that holds it is full", "Free space
        on that disk"); None when ``e`` is another error."""
        found = _unwritable(e)
        if found is None:
            return None
        return f"the catalog {self.where} cannot be written: {found[0]}", found[1]

    # -- projects and jobs -------------------------------------------------------------------

    def _project_id(self, s: Session, project: str, create: bool = True) -> int | None:
        p = s.scalar(select(Project).where(Project.name == project))
        if p is None:
            if not create:
                return None
            p = _insert_or_get(s, Project(name=project, created=utc_now()),
                               select(Project).where(Project.name == project))
        return p.id

    def _job_id(self, s: Session, project: str, job: str, create: bool = True) -> int | None:
        pid = self._project_id(s, project, create)
        if pid is None:
            return None
        j = s.scalar(select(Job).where(Job.project_id == pid, Job.name == job))
        if j is None:
            if not create:
                return None
            j = _insert_or_get(s, Job(project_id=pid, name=job, created=utc_now()),
                               select(Job).where(Job.project_id == pid, Job.name == job))
        return j.id

    def ensure_job(self, project: str, job: str) -> int:
        with self.session() as s:
            jid = self._job_id(s, project, job)
            assert jid is not None
            return jid

    def jobs(self) -> list[JobRow]:
        """Every job with its snapshot count, latest step and bytes."""
        with self.session() as s:
            rows = s.execute(
                select(Project.name, Job.name, Job.id).join(Project, Job.project_id == Project.id)
                .order_by(Project.name, Job.name)
            ).all()
            out = []
            for project, job, jid in rows:
                stats = s.execute(
                    select(func.count(), func.max(Snapshot.step), func.sum(Snapshot.new_bytes))
                    .where(Snapshot.job_id == jid, Snapshot.status == "committed")
                ).one()
                latest = s.scalar(
                    select(Snapshot.created).where(Snapshot.job_id == jid)
                    .order_by(Snapshot.seq.desc()).limit(1)
                )
                out.append(JobRow(project=project, job=job, snapshots=stats[0],
                                  max_step=stats[1], new_bytes=stats[2] or 0, latest=latest))
            return out

    def find_jobs(self, job: str) -> list[tuple[str, str]]:
        """(project, job) pairs whose job is named ``job``."""
        with self.session() as s:
            rows = s.execute(
                select(Project.name, Job.name).join(Project, Job.project_id == Project.id)
                .where(Job.name == job)
            ).all()
            return [(p, j) for p, j in rows]

    # -- snapshots ---------------------------------------------------------------------------

    def add_snapshot(self, m: Manifest, snapshot_id: str, status: str = "committed") -> None:
        """Record a committed snapshot. Idempotent."""
        with self.session() as s:
            jid = self._job_id(s, m.project, m.job)
            assert jid is not None
            row = s.get(Snapshot, snapshot_id)
            if row is None:
                seq = (s.scalar(select(func.max(Snapshot.seq)).where(Snapshot.job_id == jid))
                       or 0) + 1
                s.add(Snapshot(seq=seq,
                    id=snapshot_id, job_id=jid, step=m.step, parent=m.parent, created=m.created,
                    body=m.body, total_bytes=m.total_bytes, new_bytes=m.new_bytes,
                    tensors=m.tensors, world_size=m.world_size,
                    metrics=_json_metrics(m.metrics), status=status,
                    health=(None if m.health is None
                            else json.dumps(m.health.to_json(), sort_keys=True)),
                ))
            else:
                row.status = status

    def set_status(self, snapshot_id: str, status: str) -> None:
        with self.session() as s:
            row = s.get(Snapshot, snapshot_id)
            if row is not None:
                row.status = status

    def remove_snapshot(self, snapshot_id: str) -> None:
        with self.session() as s:
            s.execute(delete(Snapshot).where(Snapshot.id == snapshot_id))

    def _info(self, row: Snapshot, project: str, job: str) -> SnapshotInfo:
        metrics, health = row_values(row.id, row.metrics, row.health)
        return SnapshotInfo(
            id=row.id, project=project, job=job, step=row.step, parent=row.parent,
            created=row.created, total_bytes=row.total_bytes, new_bytes=row.new_bytes,
            tensors=row.tensors, world_size=row.world_size, body=row.body,
            metrics=metrics, status=row.status, seq=row.seq, health=health,
        )

    def _select(self) -> Any:
        return (
            select(Snapshot, Project.name, Job.name)
            .join(Job, Snapshot.job_id == Job.id)
            .join(Project, Job.project_id == Project.id)
        )

    def snapshots(self, project: str, job: str, *, status: str | None = "committed",
                  newest_first: bool = False) -> list[SnapshotInfo]:
        """A job's snapshots in commit order (oldest first unless ``newest_first``).

        Commit order is the catalog's insertion sequence, not wall-clock time, so a clock that
        steps back cannot make an older snapshot "latest".
        """
        q = self._select().where(Project.name == project, Job.name == job)
        if status is not None:
            q = q.where(Snapshot.status == status)
        order = (Snapshot.seq.desc(),) if newest_first else (Snapshot.seq,)
        with self.session() as s:
            return [self._info(r, p, j) for r, p, j in s.execute(q.order_by(*order)).all()]

    def all_snapshot_ids(self) -> set[str]:
        with self.session() as s:
            return set(s.scalars(select(Snapshot.id)).all())

    def latest(self, project: str, job: str) -> SnapshotInfo | None:
        snaps = self.snapshots(project, job, newest_first=True)
        return snaps[0] if snaps else None

    def get(self, snapshot_id: str) -> SnapshotInfo:
        with self.session() as s:
            row = s.execute(self._select().where(Snapshot.id == snapshot_id)).first()
            if row is None:
                raise SnapshotNotFound(f"no snapshot with ID {snapshot_id}")
            return self._info(*row)

    def find_prefix(self, prefix: str, project: str | None = None) -> SnapshotInfo:
        """The one snapshot whose ID starts with ``prefix`` (within ``project``, if given)."""
        q = self._select().where(Snapshot.id.like(prefix + "%"))
        if project is not None:
            q = q.where(Project.name == project)
        with self.session() as s:
            rows = s.execute(q.limit(6)).all()
        if not rows:
            raise SnapshotNotFound(
                f"no snapshot ID starts with {prefix!r}; `ciuic log JOB` lists a job's snapshots"
            )
        if len(rows) > 1:
            found = [self._info(*r) for r in rows[:5]]
            ids = ", ".join(f"{i.id[:16]} ({i.ref})" for i in found)
            more = ", ..." if len(rows) > 5 else ""
            raise AmbiguousReference(f"{prefix!r} matches several snapshots ({ids}{more}); "
                                     "give more characters, or JOB@STEP")
        return self._info(*rows[0])

    def by_step(self, project: str, job: str, step: int) -> SnapshotInfo:
        q = self._select().where(Project.name == project, Job.name == job, Snapshot.step == step)
        with self.session() as s:
            rows = s.execute(q.order_by(Snapshot.seq.desc())).all()
        committed = [r for r in rows if r[0].status == "committed"]
        if rows and not committed:
            raise SnapshotNotFound(f"the snapshot of {project}/{job} at step {step} was pruned "
                                   "(its manifest is kept, its data is gone)")
        rows = committed
        if not rows:
            steps = [i.step for i in self.snapshots(project, job)]
            near = ", ".join(str(x) for x in sorted(steps)[-10:]) or "none"
            raise SnapshotNotFound(
                f"job {project}/{job} has no snapshot at step {step} (latest steps: {near})"
            )
        if len(rows) > 1:  # two lineages (or branches) of the job reached this step
            which = "; ".join(f"{r[0].id[:12]} (taken {r[0].created[:19]}Z, parent "
                              f"{r[0].parent[:8] or 'none: a root'})" for r in rows)
            raise AmbiguousReference(
                f"job {project}/{job} has {len(rows)} snapshots at step {step}, in different "
                f"lineages: {which}. Name one by its ID prefix (`ciuic log {project}/{job}` "
                "shows the lineages)")
        return self._info(*rows[0])

    # -- runs --------------------------------------------------------------------------------

    def start_run(self, project: str, job: str, run_id: str) -> RunRow | None:
        """Record a new run of the job; return the previous run (how it ended) if any."""
        now = utc_now()
        with self.session() as s:
            jid = self._job_id(s, project, job)
            prev = s.scalar(select(Run).where(Run.job_id == jid)
                            .order_by(Run.started.desc()).limit(1))
            s.add(Run(id=run_id, job_id=jid, started=now, host=socket.gethostname(),
                      pid=os.getpid(), last_step=None, last_seen=now))
            s.add(RunEvent(run_id=run_id, job_id=jid, at=now, kind="start", step=None,
                           detail=f"pid {os.getpid()}"))
            return None if prev is None else _run_row(prev)

    def runs(self, project: str, job: str) -> list[RunRow]:
        """The job's runs, oldest first."""
        with self.session() as s:
            jid = self._job_id(s, project, job, create=False)
            if jid is None:
                return []
            return [_run_row(r) for r in s.scalars(select(Run).where(Run.job_id == jid)
                                                   .order_by(Run.started))]

    def stopped_at(self, run_id: str, step: int | None) -> None:
        """Record that a run which recorded no end died, learnt after it died (from its progress
        file, or from ``ciuic run``): an event ``stopped``, and its last step() (None: it made
        none) when that is later than what its heartbeats recorded."""
        with self.session() as s:
            run = s.get(Run, run_id)
            if run is None:
                return
            if step is not None and (run.last_step is None or run.last_step < step):
                run.last_step = step
            s.add(RunEvent(run_id=run_id, job_id=run.job_id, at=utc_now(), kind="stopped",
                           step=run.last_step,
                           detail="no end was recorded: it was killed or crashed"))

    def interrupted_by(self, run_id: str, cause: str) -> None:
        """Record why a run stopped, as the supervisor (``ciuic run``) saw it."""
        with self.session() as s:
            run = s.get(Run, run_id)
            if run is not None:
                run.cause = cause[:2000]
                s.add(RunEvent(run_id=run_id, job_id=run.job_id, at=utc_now(),
                               kind="interrupted", step=run.last_step, detail=run.cause))

    def restarted(self, run_id: str, number: int) -> None:
        """Record that ``ciuic run`` started this run as its restart ``number``."""
        with self.session() as s:
            run = s.get(Run, run_id)
            if run is not None:
                run.restart = number

    def heartbeat(self, run_id: str, step: int) -> None:
        with self.session() as s:
            run = s.get(Run, run_id)
            if run is not None:
                run.last_step = step
                run.last_seen = utc_now()

    def end_run(self, run_id: str, kind: str, step: int | None = None,
                at: str | None = None) -> None:
        """Record how a run ended (at ``at``: later, from its progress file, when the catalog
        could not be written then), at its last step(); the first record wins."""
        with self.session() as s:
            run = s.get(Run, run_id)
            if run is None or run.ended is not None:
                return
            run.ended = at or utc_now()
            run.end_kind = kind
            if step is not None:
                run.last_step = step
            s.add(RunEvent(run_id=run_id, job_id=run.job_id, at=run.ended, kind="end",
                           step=run.last_step, detail=kind))

    def event(self, run_id: str, project: str, job: str, kind: str, step: int | None = None,
              detail: str = "") -> None:
        with self.session() as s:
            jid = self._job_id(s, project, job)
            assert jid is not None
            s.add(RunEvent(run_id=run_id, job_id=jid, at=utc_now(), kind=kind, step=step,
                           detail=detail))

    def events(self, project: str, job: str, limit: int = 100) -> list[EventRow]:
        with self.session() as s:
            jid = self._job_id(s, project, job, create=False)
            if jid is None:
                return []
            rows = s.scalars(select(RunEvent).where(RunEvent.job_id == jid)
                             .order_by(RunEvent.id.desc()).limit(limit)).all()
            return [_event_row(r) for r in rows]

    # -- runs reported to a server by its clients (ciuic.manager.report) ---------------------

    def run_report(self, run_id: str, after_event: int) -> tuple[RunReport | None, int]:
        """A run's row and its events after ``after_event`` (an event ID), and the last ID."""
        with self.session() as s:
            run = s.get(Run, run_id)
            if run is None:
                return None, after_event
            rows = s.scalars(select(RunEvent).where(RunEvent.run_id == run_id,
                                                    RunEvent.id > after_event)
                             .order_by(RunEvent.id)).all()
            report = RunReport(RunFields(**_run_fields(run)), tuple(map(_event_row, rows)))
            return report, rows[-1].id if rows else after_event

    def record_run(self, project: str, job: str, run_id: str, report: RunReport) -> int:
        """Insert or update a run a client reported, and add the events this catalog does not
        have yet: a report is safe to send again (after a timeout, or by the next run, which
        cannot know what a killed run got through), an event already recorded is not added
        again. The number of events added."""
        fields = report.run.to_json()
        with self.session() as s:
            jid = self._job_id(s, project, job)
            run = s.get(Run, run_id)
            if run is None:
                run = Run(id=run_id, job_id=jid, **fields)
                s.add(run)
            elif run.job_id != jid:
                raise ConfigurationError(f"run {run_id} belongs to another job")
            else:
                for f, v in fields.items():
                    setattr(run, f, v)
            have = Counter(tuple(row) for row in s.execute(
                select(RunEvent.at, RunEvent.kind, RunEvent.step, RunEvent.detail)
                .where(RunEvent.run_id == run_id)))
            added = 0
            for e in report.events:
                key = (e.at, e.kind, e.step, e.detail)
                if have[key] > 0:  # this one is here already (each copy counts once)
                    have[key] -= 1
                    continue
                s.add(RunEvent(run_id=run_id, job_id=jid, at=e.at, kind=e.kind, step=e.step,
                               detail=e.detail))
                added += 1
            return added


def _run_fields(run: Run) -> dict[str, Any]:
    return {f: getattr(run, f) for f in RUN_FIELDS}


def _run_row(run: Run) -> RunRow:
    return RunRow(id=run.id, job_id=run.job_id, **_run_fields(run))


def _event_row(event: RunEvent) -> EventRow:
    return EventRow(run=event.run_id, at=event.at, kind=event.kind, step=event.step,
                    detail=event.detail)


__all__ = ["Catalog"]
