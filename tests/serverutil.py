"""A real `ciuic serve` process for the tests, and the CLI calls that give it API keys."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.s3server import free_port, http_process

KEY = re.compile(r"^ciuic_[0-9a-f]{12}_[A-Za-z0-9_-]{20,64}$")


def cli(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ciuic", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def new_key(store: Path, project: str, role: str) -> str:
    run = cli(store, "apikey", "create", "--project", project, "--role", role)
    assert run.returncode == 0, run.stderr
    key = run.stdout.strip().splitlines()[-1]
    assert KEY.match(key), run.stdout
    return key


@contextlib.contextmanager
def serve(store: Path, log: Path) -> Iterator[str]:
    with serve_process(store, log) as (url, _):
        yield url


@contextlib.contextmanager
def serve_process(store: Path, log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``ciuic serve`` on a free loopback port; its URL and its process (to stop it early)."""
    url = f"http://127.0.0.1:{(port := free_port())}"
    cmd = [sys.executable, "-m", "ciuic", "--store", str(store), "serve", "--port", str(port)]
    with http_process(cmd, f"{url}/health", log, "ciuic serve") as proc:
        yield url, proc
