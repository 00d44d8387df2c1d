"""A restore's round trips to the store before its chunks: the manifest and the body are read at
once where the catalog names the body, and a catalog catching up with its store lists the job's
manifests and bodies at once and reads the new manifests in parallel (on an object store each is
a round trip; a cold restart of every rank waits on them, docs/benchmarks.md). Checked: the
reads do overlap (each waits for the other at a barrier), and what is returned or raised is what
the reads one after another gave: the manifest's body where the catalog names another, the
manifest's damage before the body's, a damaged body named as before."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager
from ciuic.chain.read import body_states, read_body
from ciuic.chain.repo import Repository
from ciuic.errors import CorruptObject, UnreadableObject
from ciuic.format import layout
from ciuic.format.info import SnapshotInfo
from ciuic.store.memory import MemoryStore


class MeetingStore(MemoryStore):
    """A memory store where a read of each of two keys (or a listing of each of two prefixes)
    waits for the other at a barrier: ``met`` says whether they ever ran at once."""

    def __init__(self) -> None:
        super().__init__("meeting")
        self.keys: set[str] = set()
        self.prefixes: set[str] = set()
        self.met = False
        self._barrier = threading.Barrier(2, timeout=5)

    def meet(self, keys: set[str] = frozenset(), prefixes: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.keys, self.prefixes, self.met = set(keys), set(prefixes), False
        self._barrier = threading.Barrier(2, timeout=5)

    def _wait(self) -> None:
        try:
            self._barrier.wait()
            self.met = True
        except threading.BrokenBarrierError:
            pass  # one after the other: ``met`` stays False

    def get(self, key: str) -> bytes:
        if key in self.keys:
            self._wait()
        return super().get(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        if prefix in self.prefixes:
            self._wait()
        return iter(list(super().list(prefix)))


def saved(store: MemoryStore, steps: int = 1) -> list[SnapshotInfo]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    m = SnapshotManager("p", job="j", store=store, handle_signals=False, asynchronous=False)
    infos = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.add_(1.0)
        infos.append(m.save(step, model))
    m.close()
    return infos


def keys(info: SnapshotInfo) -> tuple[str, str]:
    return (layout.manifest_key(info.project, info.job, info.id),
            layout.body_key(info.project, info.job, info.body))


def test_the_manifest_and_the_body_are_read_at_once(tmp_path: Path) -> None:
    store = MeetingStore()
    info = saved(store)[0]
    repo = Repository.open(store, f"sqlite:///{tmp_path / 'c.db'}")
    store.meet(keys=set(keys(info)))
    m, states = read_body(repo, info)
    assert store.met, "the manifest and the body were read one after the other"
    assert m.body == info.body
    store.meet()
    assert states == body_states(repo, repo.read_manifest("p", "j", info.id))


def test_a_catalog_naming_another_body_gets_the_manifests(tmp_path: Path) -> None:
    store = MemoryStore("other-body")
    first, second = saved(store, steps=2)
    repo = Repository.open(store, f"sqlite:///{tmp_path / 'c.db'}")
    wrong = dataclasses.replace(second, body=first.body)  # a stale or damaged catalog row
    m, states = read_body(repo, wrong)
    assert m.body == second.body
    assert states == read_body(repo, second)[1] != read_body(repo, first)[1]


def test_a_damaged_body_is_named_and_a_damaged_manifest_first(tmp_path: Path) -> None:
    store = MemoryStore("damaged")
    info = saved(store)[0]
    repo = Repository.open(store, f"sqlite:///{tmp_path / 'c.db'}")
    manifest, body = keys(info)
    good_body = store.get(body)
    store.put(body, good_body[:-1] + bytes([good_body[-1] ^ 1]))
    with pytest.raises(CorruptObject) as e:
        read_body(repo, info)
    assert e.value.key == body
    store.delete(body)
    with pytest.raises(CorruptObject, match="missing") as e:
        read_body(repo, info)
    assert e.value.key == body
    store.put(body, good_body)
    good_manifest = store.get(manifest)
    store.put(manifest, good_manifest[:-1] + bytes([good_manifest[-1] ^ 1]))
    store.delete(body)  # both damaged: the manifest is what is reported
    with pytest.raises(CorruptObject) as e:
        read_body(repo, info)
    assert e.value.key == manifest


def test_a_catalog_lists_manifests_and_bodies_at_once_and_reads_the_new_ones(
        tmp_path: Path) -> None:
    store = MeetingStore()
    infos = saved(store, steps=3)
    damaged_key = keys(infos[1])[0]
    data = store.get(damaged_key)
    store.put(damaged_key, data[:-1] + bytes([data[-1] ^ 1]))
    repo = Repository.open(store, f"sqlite:///{tmp_path / 'fresh.db'}")  # knows nothing yet
    store.meet(prefixes={layout.manifests_prefix("p", "j"), layout.bodies_prefix("p", "j")})
    damaged: list[UnreadableObject] = []
    assert repo.sync_job("p", "j", damaged) == 2
    assert store.met, "the job's manifests and bodies were listed one after the other"
    assert [e.key for e in damaged] == [damaged_key]  # type: ignore[attr-defined]
    rows = repo.catalog.snapshots("p", "j", newest_first=True)
    assert [r.id for r in rows] == [infos[2].id, infos[0].id]
    assert [r.body for r in rows] == [infos[2].body, infos[0].body]


class CountingStore(MemoryStore):
    """A memory store that counts the reads of each key."""

    def __init__(self) -> None:
        super().__init__("counting")
        self.reads: dict[str, int] = {}

    def get(self, key: str) -> bytes:
        self.reads[key] = self.reads.get(key, 0) + 1
        return super().get(key)


def test_objects_another_rank_read_are_used_once_checked_and_the_store_read_if_damaged(
        tmp_path: Path) -> None:
    """A multi-rank restore's rank 0 reads the manifest and the body once for every rank
    (``Repository.preload``): a rank reads neither from the store; bytes damaged on the way
    are caught by the same check, and the store is read instead; each is used once."""
    store = CountingStore()
    info = saved(store)[0]
    repo = Repository.open(store, f"sqlite:///{tmp_path / 'c.db'}")
    manifest, body = keys(info)
    expected = read_body(repo, info)
    blobs = {manifest: store.get(manifest), body: store.get(body)}
    store.reads.clear()
    repo.preload(blobs)
    assert read_body(repo, info) == expected
    assert store.reads == {}  # neither came from the store
    assert read_body(repo, info) == expected  # used once: the store again
    assert store.reads == {manifest: 1, body: 1}
    store.reads.clear()
    damaged = {k: v[:-1] + bytes([v[-1] ^ 1]) for k, v in blobs.items()}
    repo.preload(damaged)
    assert read_body(repo, info) == expected
    assert store.reads == {manifest: 1, body: 1}  # each caught, read from the store
    store.reads.clear()
    repo.preload(blobs)
    repo.preload({})  # dropped: the store is read
    assert read_body(repo, info) == expected
    assert store.reads == {manifest: 1, body: 1}
