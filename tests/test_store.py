"""Behaviour particular to the local store and the store registry (the contract every store
keeps is tested in test_store_conformance.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ciuic.errors import StoreError
from ciuic.store import LocalStore, open_store


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


def test_the_speed_probe_reports_its_fastest_stretch() -> None:
    """A probe disturbed part of the way (the job starting up) reads the disk at the speed of
    its undisturbed stretch, not of the whole."""
    from ciuic.store.local import PROBE_STRETCH, _fastest

    block = 4 << 20
    per = PROBE_STRETCH // block
    times = [0.1] * 4 + [0.01] * per + [0.1] * 4
    assert _fastest(times, block) == pytest.approx(per * block / (0.01 * per))
    assert _fastest([0.1] * per * 2, block) == pytest.approx(block / 0.1)
    assert _fastest([0.2, 0.1], block) == pytest.approx(2 * block / 0.3)  # shorter than one


def test_young_temporaries_survive_gc(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "o")
    (tmp_path / "o" / ".tmp-young").write_bytes(b"a writer is using me")
    assert store.remove_temporaries(older_than_s=3600) == 0
    assert store.remove_temporaries(older_than_s=0) == 1


def test_directories_made_for_writes_not_yet_durable_are_synced_once_by_sync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh store's first chunks make a directory per prefix: their entries are made durable
    by the sync that makes the chunks durable (one fsync of their common parent), not one fsync
    each; a durable write under such a directory syncs it at once."""
    from ciuic.store import local

    synced: list[Path] = []
    real = local._fsync_path

    def spy(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    root = tmp_path / "o"
    store = LocalStore(root)
    monkeypatch.setattr(local, "_fsync_path", spy)
    for prefix in ("aa", "ab", "ac", "ad"):
        store.put(f"chunks/{prefix}/x", b"x" * 10, durable=False)
    assert synced == []  # nothing yet: the writes are not durable
    store.put("chunks/aa/y", b"y", durable=True)  # under a directory made by a deferred write
    assert synced == [root, root / "chunks", root / "chunks" / "aa"]  # its chain, then its dir
    synced.clear()
    store.sync()
    files = {root / "chunks" / p / "x" for p in ("aa", "ab", "ac", "ad")}
    dirs = {root / "chunks", *(root / "chunks" / p for p in ("aa", "ab", "ac", "ad"))}
    assert set(synced) == files | dirs and len(synced) == len(files | dirs)  # each once
    synced.clear()
    store.sync()
    assert synced == []


def test_expected_prefixes_get_their_directories_made_durable_ahead_of_the_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``expect`` makes the directories and syncs each new entry's parent once, the outermost
    first; the writes under them then make none, and their sync fsyncs only the files."""
    from ciuic.format import layout
    from ciuic.store import local
    from ciuic.store.prefix import PrefixStore

    synced: list[Path] = []
    real = local._fsync_path

    def spy(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(local, "_fsync_path", spy)
    root = tmp_path / "o"
    store = LocalStore(root)
    PrefixStore(store, "projects/p/").expect(layout.chunk_prefixes())
    chunks = root / "projects" / "p" / "chunks"
    assert sorted(p.name for p in chunks.iterdir()) == [f"{i:02x}" for i in range(256)]
    assert synced == [root, root / "projects", root / "projects" / "p", chunks]
    synced.clear()
    store.put("projects/p/chunks/ab/x", b"x", durable=False)
    store.sync()
    assert synced == [chunks / "ab" / "x", chunks / "ab"]  # the file, then its directory
    synced.clear()
    store.expect(["projects/p/chunks/ab/"])  # made already: nothing to do
    assert synced == []


def test_a_manager_makes_a_fresh_stores_chunk_directories_before_its_first_snapshot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On its writer thread, queued ahead of any snapshot: the first snapshot's write threads
    make no chunk directory."""
    import threading

    import torch

    from ciuic import SnapshotManager
    from ciuic.store import local

    made: list[tuple[str, Path]] = []  # (thread, directory) of each directory made
    ensure = LocalStore._ensure_dir

    def spy(self: LocalStore, directory: Path, durable: bool = True) -> None:
        if directory not in self._known_dirs:
            made.append((threading.current_thread().name, directory))
        ensure(self, directory, durable)

    monkeypatch.setattr(local.LocalStore, "_ensure_dir", spy)
    with SnapshotManager("p", store=tmp_path / "s", save_interval=1,
                         handle_signals=False) as m:
        m.step(1, state={"w": torch.randn(1 << 20)})  # 4 MiB: a chunk under chunks/xx/
        m.wait()
    chunk_dirs = [(t, d) for t, d in made if d.parent.name == "chunks"]
    assert len(chunk_dirs) == 256 and {t for t, _ in chunk_dirs} == {"ciuic-snapshot_0"}, made
    assert len(list((tmp_path / "s" / "objects" / "chunks").iterdir())) == 256
