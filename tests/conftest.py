from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ciuic import faults
from ciuic.chain.repo import Repository

#: CI's time budget for the slow tests (--slow-budget-min); pytester for its own test
pytest_plugins = ("tests.budget", "pytester")

HELPERS = Path(__file__).parent / "helpers"
TRAIN = HELPERS / "train_mlp.py"


@pytest.fixture(autouse=True)
def _isolate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Never touch the working directory's ./.ciuic; no failpoints unless a test sets them."""
    monkeypatch.setenv("CIUIC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CIUIC_ENDPOINT", raising=False)
    monkeypatch.delenv("CIUIC_FAILPOINTS", raising=False)
    faults.reload("")
    yield
    faults.reload("")
    logging.getLogger("ciuic").handlers.clear()


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def repo(store_dir: Path) -> Iterator[Repository]:
    r = Repository.open(store_dir)
    yield r
    r.close()


@dataclass
class Run:
    rc: int
    out: str
    err: str

    @property
    def digest(self) -> str | None:
        for line in self.out.splitlines():
            if line.startswith("DIGEST "):
                return line.split()[1]
        return None

    @property
    def start(self) -> int | None:
        for line in self.out.splitlines():
            if line.startswith("START "):
                return int(line.split()[1])
        return None


def run_train(store: Path | str, *args: str, env: dict[str, str] | None = None,
              timeout: float = 120) -> Run:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("CIUIC_HOME", None)
    proc = subprocess.run([sys.executable, str(TRAIN), "--store", str(store), *args],
                          capture_output=True, text=True, env=full_env, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="session")
def reference_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Final state digest of the uninterrupted 40-step test job."""
    r = run_train(tmp_path_factory.mktemp("ref"), "--no-snapshots")
    assert r.rc == 0, r.err
    assert r.digest
    return r.digest


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3-protocol server (moto's standalone server, from PyPI) on 127.0.0.1, for the
    whole session; tests talk to it over HTTP through boto3, nothing is patched in-process."""
    from tests.s3server import start_moto

    log = tmp_path_factory.mktemp("moto") / "server.log"
    with start_moto(log) as endpoint:
        saved = {k: os.environ.get(k) for k in _AWS_ENV}
        os.environ.update(_AWS_ENV)
        try:
            yield endpoint
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


_AWS_ENV = {"AWS_ACCESS_KEY_ID": "ciuic-test", "AWS_SECRET_ACCESS_KEY": "ciuic-test-secret",
            "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture
def s3_url(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the test server, as a store URL with a key prefix."""
    from tests.s3server import make_bucket

    bucket = make_bucket(s3_endpoint)
    return f"s3://{bucket}/ciuic?endpoint={s3_endpoint}"


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """A real PostgreSQL server on 127.0.0.1 for the whole session (Debian's package)."""
    from tests.pgserver import start_postgres

    with start_postgres() as url:
        yield url


@pytest.fixture()
def pg_url(pg_server: str, request: pytest.FixtureRequest) -> str:
    """A fresh, empty database on that server: a catalog URL."""
    import uuid

    from tests.pgserver import fresh_database

    return fresh_database(pg_server, f"t_{uuid.uuid4().hex[:12]}")
