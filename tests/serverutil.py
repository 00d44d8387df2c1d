"""A real `ciuic serve` process for the tests, and the CLI calls that give it API keys."""

from __future__ import annotations

import contextlib
import os
import re
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.s3server import free_port, http_process

KEY = re.compile(r"^ciuic_[0-9a-f]{12}_[A-Za-z0-9_-]{20,64}$")


def cli(store: Path | str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``ciuic --store STORE ARGS`` (a folder, or a server's URL) with ``env`` added."""
    return subprocess.run([sys.executable, "-m", "ciuic", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200", **env})


def new_key(store: Path, project: str, role: str) -> str:
    run = cli(store, "apikey", "create", "--project", project, "--role", role)
    assert run.returncode == 0, run.stderr
    key = run.stdout.strip().splitlines()[-1]
    assert KEY.match(key), run.stdout
    return key


@contextlib.contextmanager
def serve(store: Path, log: Path, any_keys: bool = False,
          tls: tuple[Path, Path] | None = None) -> Iterator[str]:
    """``ciuic serve`` on a free loopback port: its URL. ``any_keys``: a server that takes any
    well-formed object key, not only the layout's (tests/helpers/open_server.py: the Store
    contract's test); ``tls``: (certificate, key) files, served over HTTPS (the certificate
    names 127.0.0.1)."""
    with serving(store, log, any_keys, tls) as (url, _):
        yield url


@contextlib.contextmanager
def serving(store: Path, log: Path, any_keys: bool = False, tls: tuple[Path, Path] | None = None
            ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """:func:`serve`, yielding the server's URL and its process (to read its memory, or to
    stop it early, as an outage)."""
    port = free_port()
    cmd = [sys.executable, "-m", "ciuic", "--store", str(store), "serve", "--port", str(port)]
    if any_keys:
        cmd = [sys.executable, "-m", "tests.helpers.open_server", str(store), str(port)]
    context = None
    if tls is not None:
        cmd += ["--certfile", str(tls[0]), "--keyfile", str(tls[1])]
        context = ssl.create_default_context(cafile=str(tls[0]))
    url = f"{'http' if tls is None else 'https'}://127.0.0.1:{port}"
    with http_process(cmd, f"{url}/health", log, "ciuic serve", context) as proc:
        yield url, proc
