"""What ``ciuic ls`` and ``ciuic log`` show, read straight from a local store's SQLite catalog
with the standard library's ``sqlite3``.

The catalog (:mod:`ciuic.catalog`) is SQLAlchemy's, whose import alone takes longer than a
command line that starts at once may (0.3 s, #19). The commands first make the catalog follow
the store (:meth:`~ciuic.chain.repo.Repository.sync_job`: a row for every manifest, "pruned"
for a committed snapshot whose body is gone), then read it. When there is nothing to sync, this
module reads the same rows with the same queries (those of ``Catalog.jobs``, ``snapshots``,
``runs`` and ``events``; tests/test_listing.py checks on drawn catalogs that both return the
same rows), read-only, and never writes the file. It answers None, and the
command takes the repository's way, wherever it cannot be sure of that: a store that is not a
local folder, a read-only or mirrored one, a catalog elsewhere (``$CIUIC_CATALOG``) or absent,
damaged, or at another schema than :data:`ciuic.version.CATALOG_HEAD`; a store that lists a
manifest the catalog lacks, or a committed snapshot's body no more; a job the catalog does not
name unambiguously (the repository then says why).

Imports neither SQLAlchemy nor the catalog, nor :mod:`ciuic.chain.repo` (which does).
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import urlparse

from ciuic.chain import home
from ciuic.format import layout
from ciuic.format.records import EventRow, JobRow, RunRow
from ciuic.store.local import LocalStore
from ciuic.version import CATALOG_HEAD, CATALOG_SCHEMA_VERSION

if TYPE_CHECKING:  # imported by `log` alone (with ciuic.format.manifest): `ls` needs neither
    from ciuic.format.info import SnapshotInfo

_JOBS = "FROM jobs JOIN projects ON jobs.project_id = projects.id"
_SNAPSHOTS = ("FROM snapshots JOIN jobs ON snapshots.job_id = jobs.id "
              "JOIN projects ON jobs.project_id = projects.id")
_A_JOB = "WHERE projects.name = ? AND jobs.name = ?"
#: the most events of a job that ``ciuic log`` reads
EVENTS = 100_000
T = TypeVar("T")


@dataclass(frozen=True)
class JobLog:
    """What ``ciuic log`` shows of a job: every snapshot (pruned too), newest first; its runs,
    oldest first; its events, newest first."""

    project: str
    job: str
    snapshots: list[SnapshotInfo]
    runs: list[RunRow]
    events: list[EventRow]


def read_jobs(location: str) -> list[JobRow] | None:
    """``Catalog.jobs()`` of the store at ``location``, as it is once every job of the store is
    synced; None where only the repository can tell."""
    return _read(location, lambda reader: reader.jobs() if reader.in_sync(None) else None)


def read_log(location: str, job: str) -> JobLog | None:
    """What ``ciuic log JOB`` shows of ``job`` (``PROJECT/JOB``, or a ``JOB`` unique across
    projects) in the store at ``location``, as it is once the job is synced; None where only
    the repository can tell."""

    def read(reader: _Reader) -> JobLog | None:
        named = reader.find_job(job)
        if named is None or not reader.in_sync(named):
            return None
        jid = reader.job_id(*named)
        return JobLog(*named, reader.snapshots(*named), reader.runs(jid), reader.events(jid))

    return _read(location, read)


def _read(location: str, read: Callable[[_Reader], T | None]) -> T | None:
    reader = _Reader.open(location)
    if reader is None:
        return None
    try:
        return read(reader)
    except sqlite3.Error:  # damaged, or locked past the timeout: the repository will say
        return None
    finally:
        reader.close()


class _Reader:
    """One read transaction on a catalog that is at the schema head."""

    def __init__(self, db: sqlite3.Connection, store: LocalStore) -> None:
        self.db = db
        self.store = store

    @classmethod
    def open(cls, location: str) -> _Reader | None:
        if urlparse(location).scheme or any(os.environ.get(v) for v in (
                "CIUIC_CATALOG", "CIUIC_MIRROR")):
            return None
        root = Path(location).expanduser()
        path = root / "catalog.db"
        if not (root / "objects").is_dir() or home.read_only(root) or not path.is_file():
            return None
        try:
            db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
        except sqlite3.Error:
            return None
        try:
            db.execute("BEGIN")  # every read below sees one state of the catalog
            version = db.execute("SELECT version_num FROM alembic_version").fetchone()
            schema = db.execute("SELECT value FROM ciuic_meta WHERE key = 'schema_version'"
                                ).fetchone()
            if (version is not None and version[0] == CATALOG_HEAD and schema is not None
                    and str(schema[0]).isdigit() and int(schema[0]) <= CATALOG_SCHEMA_VERSION):
                return cls(db, LocalStore(root / "objects"))
        except sqlite3.Error:
            pass
        db.close()
        return None

    def close(self) -> None:
        self.db.close()

    def in_sync(self, job: tuple[str, str] | None) -> bool:
        """Whether ``Repository.sync_job`` would change nothing: for ``job``, or (None) for
        every job the store holds a manifest of. The catalog must know each manifest the store
        lists, and the body of each snapshot it holds committed must be in the store."""
        served = self.store.children(layout.PROJECTS)  # a server's storage: its projects
        if job is None:
            where = [(self.store, layout.jobs_prefix(), served),
                     *((self._served(p), layout.jobs_prefix(p), []) for p in served)]
        elif job[0] in served:
            where = [(self._served(job[0]), layout.job_prefix(*job), [])]
        else:
            where = [(self.store, layout.job_prefix(*job), [])]
        listed: dict[tuple[str, str], set[str]] = {}
        bodies: dict[tuple[str, str], set[str]] = {}
        for key in (k for store, prefix, hidden in where for k in store.list(prefix)
                    if k.split("/", 2)[1] not in hidden):
            manifest, body = layout.parse_manifest(key), layout.parse_body(key)
            if manifest is not None:
                listed.setdefault((manifest.project, manifest.job), set()).add(
                    manifest.snapshot_id)
            elif body is not None:
                bodies.setdefault(body[:2], set()).add(body[2])
        synced: Iterable[tuple[str, str]] = listed if job is None else [job]
        query = f"SELECT snapshots.id, snapshots.body, snapshots.status {_SNAPSHOTS} {_A_JOB}"
        for name in synced:
            known = set()
            for sid, body_digest, status in self.db.execute(query, name):
                known.add(sid)
                if status == "committed" and body_digest not in bodies.get(name, ()):
                    return False  # sync_job marks it pruned
            if not listed.get(name, set()) <= known:
                return False  # sync_job adds it
        return True

    def _served(self, project: str) -> LocalStore:
        """The store a server keeps ``project`` in: ``projects/<project>/`` of this one."""
        return LocalStore(self.store.root / layout.PROJECTS / project)

    def jobs(self) -> list[JobRow]:
        """As ``Catalog.jobs``."""
        out = []
        rows = self.db.execute(f"SELECT projects.name, jobs.name, jobs.id {_JOBS} "
                               "ORDER BY projects.name, jobs.name").fetchall()
        for project, job, jid in rows:
            count, max_step, new_bytes = self.db.execute(
                "SELECT count(*), max(step), sum(new_bytes) FROM snapshots "
                "WHERE job_id = ? AND status = 'committed'", (jid,)).fetchone()
            latest = self.db.execute("SELECT created FROM snapshots WHERE job_id = ? "
                                     "ORDER BY seq DESC LIMIT 1", (jid,)).fetchone()
            out.append(JobRow(project=project, job=job, snapshots=count, max_step=max_step,
                              new_bytes=new_bytes or 0, latest=latest[0] if latest else None))
        return out

    def find_job(self, text: str) -> tuple[str, str] | None:
        """The job ``text`` names, as ``Repository.split_job`` finds it in the catalog; None
        where it would look in the store, or refuse."""
        project, slash, job = text.partition("/")
        named = self.db.execute(f"SELECT projects.name, jobs.name {_JOBS} WHERE jobs.name = ?",
                                (job if slash else text,)).fetchall()
        if slash:
            return (project, job) if (project, job) in named else None
        return named[0] if len(named) == 1 else None

    def job_id(self, project: str, job: str) -> int:
        row = self.db.execute(f"SELECT jobs.id {_JOBS} {_A_JOB}", (project, job)).fetchone()
        return int(row[0])

    def snapshots(self, project: str, job: str) -> list[SnapshotInfo]:
        """As ``Catalog.snapshots(project, job, status=None, newest_first=True)``."""
        from ciuic.format.info import SnapshotInfo, row_values

        rows = self.db.execute(f"SELECT {', '.join('snapshots.' + c for c in _INFO)} "
                               f"{_SNAPSHOTS} {_A_JOB} ORDER BY snapshots.seq DESC",
                               (project, job))
        out = []
        for row in rows:
            fields = dict(zip(_INFO, row, strict=True))
            fields["metrics"], fields["health"] = row_values(fields["id"], fields["metrics"],
                                                             fields["health"])
            out.append(SnapshotInfo(project=project, job=job, **fields))
        return out

    def runs(self, jid: int) -> list[RunRow]:
        """As ``Catalog.runs``: oldest first."""
        rows = self.db.execute(f"SELECT {', '.join(_RUN)} FROM runs WHERE runs.job_id = ? "
                               "ORDER BY runs.started", (jid,))
        return [RunRow(*row) for row in rows]

    def events(self, jid: int) -> list[EventRow]:
        """As ``Catalog.events(project, job, limit=EVENTS)``: newest first."""
        rows = self.db.execute("SELECT run_id, at, kind, step, detail FROM run_events "
                               "WHERE run_events.job_id = ? ORDER BY run_events.id DESC "
                               "LIMIT ?", (jid, EVENTS))
        return [EventRow(*row) for row in rows]


#: the columns of a snapshot's row that make its SnapshotInfo, by the field's name
_INFO = ("id", "step", "parent", "created", "total_bytes", "new_bytes", "tensors", "world_size",
         "body", "metrics", "status", "seq", "health")
_RUN = tuple(f"runs.{f.name}" for f in dataclasses.fields(RunRow))
