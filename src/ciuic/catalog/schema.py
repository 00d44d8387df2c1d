"""The catalog's schema, kept by Alembic migrations (``catalog/migrations/versions``).

Every :class:`~ciuic.catalog.Catalog` brings its database to :data:`HEAD` when it opens it:
a new database gets every migration, a catalog created before migrations existed (tables but
no ``alembic_version``) is stamped at ``0001`` and upgraded. When the database is already at
``HEAD`` (the usual case) one small query decides that and Alembic is not even imported. A
database migrated by a newer ciuic (an unknown revision) is refused with "upgrade ciuic".
Several processes opening a new catalog at once race on the same DDL; the loser's error is a
race, not damage, and the catalog retries (``Catalog.__init__``).
"""

from __future__ import annotations

import contextlib
import fcntl
import threading
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Connection, Engine, inspect, text

from ciuic.errors import ConfigurationError
from ciuic.version import CATALOG_HEAD

#: The newest migration (kept in ``ciuic.version``, which imports no SQLAlchemy).
HEAD = CATALOG_HEAD
KNOWN = ("0001", "0002", "0003", "0004")
MIGRATIONS = Path(__file__).with_name("migrations")


def current(conn: Connection) -> str | None:
    """The database's revision, or None when it has no ``alembic_version`` table."""
    if not inspect(conn).has_table("alembic_version"):
        return None
    row = conn.execute(text("SELECT version_num FROM alembic_version")).first()
    return None if row is None else str(row[0])


_IN_PROCESS = threading.Lock()  # Alembic's command API keeps global state: one at a time
_PG_LOCK_ID = 0x6369756963  # "ciuic": the advisory lock PostgreSQL migrations hold


def bring_to_head(engine: Engine, url: str) -> None:
    """Migrate ``engine``'s database to :data:`HEAD` if it is not there yet.

    At the head this is one query. Otherwise the migration runs under locks, so that many
    processes and threads opening one new catalog at once (ranks starting together, a server's
    clients) migrate it exactly once: a thread lock (Alembic is not thread-safe), a file lock
    beside a SQLite file, a transaction-scoped advisory lock on PostgreSQL; the version is read
    again under them."""
    with engine.connect() as conn:
        if current(conn) == HEAD:
            return
    with _IN_PROCESS, _file_lock(url), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text(f"SELECT pg_advisory_xact_lock({_PG_LOCK_ID})"))
        migrate(conn, url)


@contextlib.contextmanager
def _file_lock(url: str) -> Iterator[None]:
    path = url.split("///", 1)[1] if url.startswith("sqlite:///") else ""
    if not path or path == ":memory:":
        yield
        return
    with open(f"{path}.migrate-lock", "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def migrate(conn: Connection, url: str) -> None:
    """Bring the database behind ``conn`` to :data:`HEAD` (in the caller's transaction)."""
    version = current(conn)
    if version == HEAD:
        return
    if version is not None and version not in KNOWN:
        raise ConfigurationError(f"catalog {url} is at schema revision {version}, newer than "
                                 f"this ciuic understands ({HEAD}); upgrade ciuic")
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["connection"] = conn
    if version is None and inspect(conn).has_table("snapshots"):
        command.stamp(cfg, "0001")  # made by create_all before migrations existed
    command.upgrade(cfg, HEAD)
