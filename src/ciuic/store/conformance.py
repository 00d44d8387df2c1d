"""The conformance suite of the :class:`~ciuic.store.Store` contract, for every backend: ciuic's
own (local, memory, S3, HTTP, prefix, mirror, retrying) and a third party's.

A backend's tests subclass :class:`StoreConformance` and provide a ``store`` fixture that yields
a fresh, empty store (as fsspec's abstract tests and restic's backend test suite do)::

    import pytest
    from ciuic.store.conformance import StoreConformance

    class TestMyStore(StoreConformance):
        @pytest.fixture
        def store(self, tmp_path):
            s = MyStore(tmp_path)
            yield s
            s.close()

Every test uses keys under ``conformance/``, ``jobs/p/`` and ``chunks/`` only (a server-backed
store for project ``p`` accepts them). This module needs pytest; ``import ciuic`` never imports
it.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ciuic.errors import InvalidKey, ObjectNotFound
from ciuic.store.base import Store

BAD_KEYS = ["", "../etc/passwd", "a/../b", "/abs", "a//b", "a/./b", "sp ace", "a\\b",
            "back\x00slash", "x" * 300, "/".join(["abcdefgh"] * 120)]


class StoreConformance:
    """The Store contract, one test per promise of :class:`~ciuic.store.Store`'s docstrings."""

    def test_put_get_has_round_trip(self, store: Store) -> None:
        assert not store.has("conformance/a/b")
        store.put("conformance/a/b", b"hello")
        assert store.has("conformance/a/b")
        assert store.get("conformance/a/b") == b"hello"
        store.put("conformance/a/b", memoryview(b"again"))  # put replaces
        assert store.get("conformance/a/b") == b"again"

    def test_empty_object(self, store: Store) -> None:
        store.put("conformance/empty", b"")
        assert store.get("conformance/empty") == b""
        assert store.has("conformance/empty")

    def test_a_list_of_buffers_is_one_object(self, store: Store) -> None:
        store.put("conformance/parts", [b"head", bytearray(b"-"), memoryview(b"payload")])
        assert store.get("conformance/parts") == b"head-payload"
        assert store.create("conformance/created", [b"a", b"b"]) is True
        assert store.get("conformance/created") == b"ab"

    def test_a_large_object_round_trips(self, store: Store) -> None:
        data = bytes(range(256)) * (3 * 4096 + 7)  # 3 MiB and a bit, not a power of two
        store.put("conformance/large", data)
        assert store.get("conformance/large") == data

    def test_missing_key_raises_object_not_found_which_is_a_key_error(self, store: Store
                                                                       ) -> None:
        with pytest.raises(ObjectNotFound) as e:
            store.get("conformance/no/such/key")
        assert isinstance(e.value, KeyError)
        assert "conformance/no/such/key" in str(e.value)
        assert store.has("conformance/no/such/key") is False

    def test_create_is_create_if_absent(self, store: Store) -> None:
        assert store.create("conformance/m/1", b"first") is True
        assert store.create("conformance/m/1", b"second") is False
        assert store.get("conformance/m/1") == b"first"

    def test_create_races_have_exactly_one_winner(self, store: Store) -> None:
        results: dict[int, bool] = {}
        barrier = threading.Barrier(8)

        def worker(i: int) -> None:
            barrier.wait()
            results[i] = store.create("conformance/race", f"writer {i}".encode())

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [i for i, created in results.items() if created]
        assert len(results) == 8 and len(winners) == 1
        assert store.get("conformance/race") == f"writer {winners[0]}".encode()

    def test_list_by_prefix_is_sorted_and_exact(self, store: Store) -> None:
        keys = ["jobs/p/j/manifests/b.json", "jobs/p/j/manifests/a.json", "jobs/p/k/x",
                "chunks/aa/1", "chunks/ab/2", "chunks/b0/3"]
        for key in keys:
            store.put(key, b"x")
        assert list(store.list("jobs/p/j/")) == ["jobs/p/j/manifests/a.json",
                                                  "jobs/p/j/manifests/b.json"]
        assert list(store.list("chunks/a")) == ["chunks/aa/1", "chunks/ab/2"]
        everything = list(store.list())
        assert everything == sorted(everything)
        assert set(keys) <= set(everything)
        assert list(store.list("conformance/nothing/")) == []

    def test_children_are_the_names_one_level_down(self, store: Store) -> None:
        for key in ("conformance/c/projects/a/jobs/a/x", "conformance/c/projects/a/chunks/1",
                    "conformance/c/projects/b2/y", "conformance/c/projects/top",
                    "conformance/c/projectsX/z"):
            store.put(key, b"x")
        assert store.children("conformance/c/projects/") == ["a", "b2", "top"]
        assert store.children("conformance/c/projects/a/") == ["chunks", "jobs"]
        assert store.children("conformance/c/nothing/") == []
        with pytest.raises(ValueError, match="ends with '/'"):
            store.children("conformance/c/projects")

    def test_list_does_not_show_deleted_keys(self, store: Store) -> None:
        store.put("conformance/l/1", b"x")
        store.put("conformance/l/2", b"y")
        store.delete("conformance/l/1")
        assert list(store.list("conformance/l/")) == ["conformance/l/2"]

    def test_delete_is_idempotent(self, store: Store) -> None:
        store.put("conformance/d/1", b"x")
        store.delete("conformance/d/1")
        store.delete("conformance/d/1")
        assert not store.has("conformance/d/1")
        with pytest.raises(ObjectNotFound):
            store.get("conformance/d/1")

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_bad_keys_are_rejected(self, store: Store, key: str) -> None:
        with pytest.raises(InvalidKey):
            store.put(key, b"x")
        with pytest.raises(InvalidKey):
            store.get(key)
        with pytest.raises(InvalidKey):
            store.create(key, b"x")

    def test_get_into_reads_back_to_back_and_reports_size(self, store: Store) -> None:
        store.put("conformance/g/1", [b"head", b"-", b"payload"])
        a, b = bytearray(5), bytearray(7)
        assert store.get_into("conformance/g/1", [memoryview(a), memoryview(b)]) == 12
        assert (a, b) == (bytearray(b"head-"), bytearray(b"payload"))
        short = bytearray(4)
        assert store.get_into("conformance/g/1", [memoryview(short)]) == 12
        assert short == b"head"
        long = bytearray(20)
        assert store.get_into("conformance/g/1", [memoryview(long)]) == 12
        assert long[:12] == b"head-payload" and long[12:] == bytes(8)  # the tail untouched
        with pytest.raises(ObjectNotFound):
            store.get_into("conformance/g/missing", [memoryview(a)])

    def test_get_into_reads_a_range_from_an_offset(self, store: Store) -> None:
        """A piece inside a larger object (a chunk in a pack) is read alone: from ``offset``,
        as many bytes as the buffers hold; the object's size is returned whatever the range."""
        data = bytes(range(256)) * 400  # 102,400 bytes
        store.put("conformance/r/1", data)
        a, b = bytearray(10), bytearray(30)
        assert store.get_into("conformance/r/1", [memoryview(a), memoryview(b)], 1000) == 102400
        assert bytes(a + b) == data[1000:1040]
        tail = bytearray(b"\xff" * 64)  # only the last 24 bytes exist past 102,376
        assert store.get_into("conformance/r/1", [memoryview(tail)], 102376) == 102400
        assert tail[:24] == data[102376:] and tail[24:] == b"\xff" * 40
        for past in (102400, 200000):  # at or past the end: nothing read, the size told
            untouched = bytearray(b"\xee" * 8)
            assert store.get_into("conformance/r/1", [memoryview(untouched)], past) == 102400
            assert untouched == b"\xee" * 8
        assert store.get_into("conformance/r/1", [], 5) == 102400  # no buffers: the size
        with pytest.raises(ValueError, match="offset"):
            store.get_into("conformance/r/1", [memoryview(a)], -1)
        with pytest.raises(ObjectNotFound):
            store.get_into("conformance/r/missing", [memoryview(a)], 10)

    def test_non_durable_puts_are_readable_and_durable_after_sync(self, store: Store) -> None:
        for i in range(20):
            store.put(f"conformance/batch/{i:02d}", f"v{i}".encode(), durable=False)
        assert store.get("conformance/batch/07") == b"v7"  # readable before the sync
        store.sync()
        store.sync()  # idempotent
        assert [store.get(f"conformance/batch/{i:02d}") for i in range(20)] == [
            f"v{i}".encode() for i in range(20)]

    def test_put_many_writes_each_object(self, store: Store) -> None:
        items = [(f"conformance/many/{i:02d}", f"m{i}".encode() * (i + 1)) for i in range(12)]
        store.put_many(items[:6])
        store.put_many(items[6:], durable=False)
        store.put_many([])
        store.sync()
        assert [store.get(k) for k, _ in items] == [v for _, v in items]
        assert store.missing([k for k, _ in items]) == []

    def test_missing_answers_in_order(self, store: Store) -> None:
        store.put("conformance/have/1", b"x")
        store.put("conformance/have/3", b"x")
        asked = [f"conformance/have/{i}" for i in range(5)]
        assert store.missing(asked) == ["conformance/have/0", "conformance/have/2",
                                        "conformance/have/4"]
        assert store.missing([]) == []

    def test_concurrent_writers_and_readers(self, store: Store) -> None:
        def one(i: int) -> bytes:
            key = f"conformance/c/{i:03d}"
            store.put(key, f"value {i}".encode() * 100, durable=bool(i % 2))
            return store.get(key)

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, range(64)))
        store.sync()
        assert got == [f"value {i}".encode() * 100 for i in range(64)]
        assert len(list(store.list("conformance/c/"))) == 64

    def test_lock_is_a_context_manager_and_rejects_bad_names(self, store: Store) -> None:
        with store.lock("jobs/p/j/commit"):
            store.put("conformance/locked", b"x")
        with store.lock("jobs/p/j/commit"):  # released: taken again at once
            pass
        with pytest.raises(InvalidKey), store.lock("../escape"):
            pass

    def test_copies_location_and_url(self, store: Store) -> None:
        copies = store.copies()
        assert copies and copies[0] is not None
        assert isinstance(store.url, str) and store.url
        assert "conformance/x" in store.location("conformance/x")
        assert isinstance(store.location(), str)

    def test_write_speed_is_positive(self, store: Store) -> None:
        one, together = store.write_speed(measure=False)
        assert one > 0
        assert together is None or together > 0
