"""32 concurrent clients save and restore against a real `ciuic serve`, each at least three
times (so each restores at least once), then until 6 s passed: nothing lost, nothing corrupted,
no error (bench/server_load.py; figures in docs/server.md). The amount of work is bounded by
count, not time, so the result does not depend on the machine's speed."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serverutil import new_key, serve

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from server_load import run


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    store = tmp_path / "store"
    key = new_key(store, "load", "writer")
    with serve(store, tmp_path / "server.log") as url:
        yield url, key


def test_32_clients_lose_and_corrupt_nothing(server: tuple[str, str]) -> None:
    url, key = server
    out = run(url, key, clients=32, seconds=6.0, min_saves=3)
    assert out["error_count"] == 0, out["errors"]
    assert out["lost"] == 0 and out["corrupted"] == 0, out
    assert out["saves"] >= 3 * 32 and out["restores"] >= 32, out
