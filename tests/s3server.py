"""Start and use moto's standalone S3 server (a real HTTP server) for the tests."""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_counter = itertools.count()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def http_process(cmd: list[str], probe: str, log: Path, what: str,
                 tls: ssl.SSLContext | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` (a server), wait until ``probe`` answers (over ``tls``, for https), stop it
    afterwards; yield its process (a test may stop it early, as an outage)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    urllib.request.urlopen(probe, timeout=2, context=tls).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{what} did not start: {log.read_text()[-3000:]}") from None
                    time.sleep(0.2)
            yield proc
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a server process; kill it if it does not exit within 20 s."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()


@contextlib.contextmanager
def start_moto(log: Path) -> Iterator[str]:
    """Run ``moto.server`` on a free loopback port; yield its endpoint URL."""
    with moto_process(log) as (endpoint, _):
        yield endpoint


@contextlib.contextmanager
def moto_process(log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Run ``moto.server`` on a free loopback port; yield its endpoint URL and its process."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with http_process(cmd, f"{endpoint}/moto-api/", log, "moto server") as proc:
        yield endpoint, proc


def client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "ciuic-test"),
                        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "x"))


def make_bucket(endpoint: str) -> str:
    name = f"ciuic-test-{os.getpid()}-{next(_counter)}"
    client(endpoint).create_bucket(Bucket=name)
    return name
