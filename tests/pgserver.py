"""Start a real PostgreSQL server (Debian's package, installed by scripts/services.sh) on
127.0.0.1 for the tests: initdb into a fresh directory, trust authentication, fsync off."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.s3server import free_port, stop


def _bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    raise RuntimeError("PostgreSQL is not installed: run scripts/services.sh (as root) or "
                       "install Debian's 'postgresql' package")


@contextlib.contextmanager
def start_postgres() -> Iterator[str]:
    """Yield a SQLAlchemy URL of a superuser connection to the server's ``postgres`` database."""
    bindir = _bindir()
    base = Path(tempfile.mkdtemp(prefix="ciuic-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        import pwd

        pw = pwd.getpwnam("postgres")
        os.chown(base, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, log = base / "data", base / "server.log"
    subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U",
                    "ciuic", "--no-sync", "-E", "UTF8"], check=True, capture_output=True)
    port = free_port()
    proc = subprocess.Popen(
        [*as_user, str(bindir / "postgres"), "-D", str(data), "-p", str(port), "-k", str(base),
         "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
         "-c", "full_page_writes=off", "-c", "logging_collector=off"],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"postgresql+psycopg://ciuic@127.0.0.1:{port}/postgres"
    try:
        import psycopg

        deadline = time.monotonic() + 60
        while True:
            try:
                psycopg.connect(f"host=127.0.0.1 port={port} user=ciuic dbname=postgres",
                                connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"PostgreSQL did not start: {log.read_text()[-2000:]}"
                                       ) from None
                time.sleep(0.2)
        yield url
    finally:
        # a fast shutdown (clients disconnected, shared memory released); SIGTERM to runuser
        # is a smart one, which waits for the pools' idle connections until it is killed and
        # leaves its dynamic shared memory segments in /dev/shm
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast",
                            "-w", "-t", "30", "stop"], capture_output=True, timeout=40)
        stop(proc)
        shutil.rmtree(base, ignore_errors=True)


def fresh_database(server_url: str, name: str) -> str:
    """Create database ``name`` on the server; return its URL."""
    import psycopg

    dsn = server_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return server_url.rsplit("/", 1)[0] + f"/{name}"
