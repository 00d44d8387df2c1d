"""Every store ciuic ships passes the Store contract (ciuic.store.conformance): local, memory,
S3 (against the moto server), HTTP (against a real `ciuic serve`), a store inside another
(prefix), a mirror of two tiers, and the retrying wrapper."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ciuic.store import LocalStore, MemoryStore, Store, open_store
from ciuic.store.conformance import StoreConformance
from ciuic.store.http import HttpStore
from ciuic.store.mirror import MirrorStore
from ciuic.store.prefix import PrefixStore
from ciuic.store.retry import RetryingStore
from tests.serverutil import new_key, serve


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        with LocalStore(tmp_path / "objects") as s:
            yield s


class TestMemoryStore(StoreConformance):
    @pytest.fixture
    def store(self) -> Iterator[Store]:
        with MemoryStore() as s:
            yield s


class TestS3Store(StoreConformance):
    @pytest.fixture
    def store(self, s3_url: str) -> Iterator[Store]:
        with open_store(s3_url) as s:
            yield s


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    root = tmp_path_factory.mktemp("conformance-server") / "store"
    key = new_key(root, "p", "writer")
    # the contract's keys are not ciuic's: a server that takes any well-formed key
    with serve(root, root.parent / "server.log", any_keys=True) as url:
        yield url, key


class TestHttpStore(StoreConformance):
    """Each test gets a project of its own on one server (a store is fresh and empty)."""

    @pytest.fixture
    def store(self, server: tuple[str, str]) -> Iterator[Store]:
        url, key = server
        s = HttpStore(url, "p", key)
        for k in list(s.list()):  # the previous test's objects (the server keeps manifests)
            s.delete(k)
        yield s
        s.close()


class TestPrefixStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        inner = LocalStore(tmp_path / "objects")
        inner.put("outside/the/prefix", b"not listed")
        with PrefixStore(inner, "projects/p/") as s:
            yield s
        assert inner.get("outside/the/prefix") == b"not listed"


class TestMirrorStore(StoreConformance):
    @pytest.fixture(params=["local", "remote"])
    def store(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
        with MirrorStore(LocalStore(tmp_path / "fast"), MemoryStore(),
                         durability=request.param) as s:
            yield s


class TestRetryingStore(StoreConformance):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        with RetryingStore(LocalStore(tmp_path / "objects"), attempts=2, timeout_s=30,
                           backoff_s=0.01) as s:
            yield s
