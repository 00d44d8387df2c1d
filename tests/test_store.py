"""The conformance suite every Store backend passes."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ciuic.errors import InvalidKey, ObjectNotFound, StoreError
from ciuic.store import LocalStore, MemoryStore, Store, open_store


@pytest.fixture(params=["local", "memory", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "local":
        s: Store = LocalStore(tmp_path / "objects")
    elif request.param == "s3":
        s = open_store(request.getfixturevalue("s3_url"))
    else:
        s = MemoryStore()
    yield s
    s.close()


def test_put_get_has_round_trip(store: Store) -> None:
    assert not store.has("a/b")
    store.put("a/b", b"hello")
    assert store.has("a/b")
    assert store.get("a/b") == b"hello"
    store.put("a/b", memoryview(b"again"))
    assert store.get("a/b") == b"again"


def test_empty_object(store: Store) -> None:
    store.put("empty", b"")
    assert store.get("empty") == b""
    assert store.has("empty")


def test_missing_key_raises_object_not_found_which_is_a_key_error(store: Store) -> None:
    with pytest.raises(ObjectNotFound) as e:
        store.get("no/such/key")
    assert isinstance(e.value, KeyError)
    assert "no/such/key" in str(e.value)


def test_create_is_create_if_absent(store: Store) -> None:
    assert store.create("m/1", b"first") is True
    assert store.create("m/1", b"second") is False
    assert store.get("m/1") == b"first"


def test_create_races_have_exactly_one_winner(store: Store) -> None:
    results: list[bool] = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()
        results.append(store.create("race/key", f"writer {i}".encode()))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1
    assert store.get("race/key").startswith(b"writer ")


def test_list_by_prefix_sorted(store: Store) -> None:
    for key in ("jobs/p/j/manifests/b.json", "jobs/p/j/manifests/a.json", "jobs/p/k/x",
                "chunks/aa/1", "chunks/ab/2"):
        store.put(key, b"x")
    assert list(store.list("jobs/p/j/")) == ["jobs/p/j/manifests/a.json",
                                              "jobs/p/j/manifests/b.json"]
    assert list(store.list("chunks/a")) == ["chunks/aa/1", "chunks/ab/2"]
    assert len(list(store.list())) == 5
    assert list(store.list("nothing/")) == []


def test_delete_is_idempotent(store: Store) -> None:
    store.put("d/1", b"x")
    store.delete("d/1")
    store.delete("d/1")
    assert not store.has("d/1")
    with pytest.raises(ObjectNotFound):
        store.get("d/1")


@pytest.mark.parametrize("key", ["", "../etc/passwd", "a/../b", "/abs", "a//b", "a/./b",
                                 "sp ace", "a\\b", "back\x00slash", "x" * 300,
                                 "/".join(["abcdefgh"] * 120)])
def test_bad_keys_are_rejected(store: Store, key: str) -> None:
    with pytest.raises(InvalidKey):
        store.put(key, b"x")
    with pytest.raises(InvalidKey):
        store.get(key)


def test_local_store_leaves_no_temporaries_and_fails_clearly(tmp_path: Path) -> None:
    s = LocalStore(tmp_path / "o")
    s.put("x/y", b"1")
    s.create("x/z", b"2")
    assert sorted(p.name for p in (tmp_path / "o" / "x").iterdir()) == ["y", "z"]
    (tmp_path / "o" / "x" / ".tmp-abandoned").write_bytes(b"partial")
    assert list(s.list("x/")) == ["x/y", "x/z"]
    assert s.remove_temporaries() == 1
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    with pytest.raises(StoreError, match="cannot create the store directory"):
        LocalStore(blocker / "sub")


def test_open_store_by_url(tmp_path: Path) -> None:
    assert isinstance(open_store(tmp_path / "a"), LocalStore)
    assert isinstance(open_store(f"file://{tmp_path}/b"), LocalStore)
    m = open_store("memory://shared-test")
    assert m is open_store("memory://shared-test")
    with pytest.raises(ValueError, match="unknown store URL scheme 'gopher'"):
        open_store("gopher://x")


def test_get_into_reads_back_to_back_and_reports_size(store: Store) -> None:
    store.put("g/1", [b"head", b"-", b"payload"])  # a list of buffers is one object
    assert store.get("g/1") == b"head-payload"
    a, b = bytearray(5), bytearray(7)
    assert store.get_into("g/1", [memoryview(a), memoryview(b)]) == 12
    assert (a, b) == (bytearray(b"head-"), bytearray(b"payload"))
    short = bytearray(4)
    assert store.get_into("g/1", [memoryview(short)]) == 12 and short == b"head"
    long = bytearray(20)
    assert store.get_into("g/1", [memoryview(long)]) == 12 and long[:12] == b"head-payload"
    with pytest.raises(ObjectNotFound):
        store.get_into("g/missing", [memoryview(a)])


def test_non_durable_puts_become_durable_on_sync(store: Store) -> None:
    for i in range(20):
        store.put(f"batch/{i:02d}/x", f"v{i}".encode(), durable=False)
    store.sync()
    store.sync()  # idempotent
    assert [store.get(f"batch/{i:02d}/x") for i in range(20)] == [f"v{i}".encode()
                                                                   for i in range(20)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_chunks_written_without_fsync_start_their_writeback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ciuic.store import local

    started: list[int] = []
    real = local._start_writeback
    assert real.__closure__ is not None  # libc's sync_file_range was found, not the no-op

    def spy(fd: int) -> None:
        started.append(fd)
        real(fd)

    monkeypatch.setattr(local, "_start_writeback", spy)
    store = LocalStore(tmp_path / "o")
    store.put("chunks/ab/one", b"x" * 100_000, durable=False)
    store.put("meta/two", b"y", durable=True)  # fsync'ed at once: no separate writeback
    assert len(started) == 1
    store.sync()
    assert store.get("chunks/ab/one") == b"x" * 100_000
    real(-1)  # a failing call (bad descriptor, a file system without it) raises nothing
