"""A store on a full disk and on a read-only file system, each a real tmpfs the test mounts
(root, or CAP_SYS_ADMIN; elsewhere skipped, with the reason). Each test failed before its fix:
a failed snapshot left its chunks behind and `ciuic gc` could not take its lock on the full
disk; prune and gc retried a read-only file system three times in a long line that never said
"read-only", and reindex reported success."""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager, knobs
from ciuic.chain.gc import collect
from ciuic.chain.repo import Repository
from ciuic.chain.retention import prune, prune_one
from ciuic.store.local import RESERVE_BYTES
from tests.models import model_opt


def _mount(disk: Path, size: str) -> None:
    disk.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                              capture_output=True, text=True, timeout=30)
    except OSError as e:
        pytest.skip(f"cannot mount a tmpfs ({e}): this test needs mount(8)")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs ({done.stderr.strip()}): this test needs root")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of its own (4 MiB), to fill or to make read-only."""
    where = tmp_path / "disk"
    _mount(where, "4m")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def ciuic(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ciuic", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def fill(disk: Path) -> None:
    """Write a file on ``disk`` until it is full."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(4096))
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def chunk_files(store: Path) -> set[Path]:
    return {p for p in (store / "objects" / "chunks").rglob("*") if p.is_file()}


@pytest.fixture
def chunk_objects() -> Iterator[None]:
    """Every piece its own chunk object: the test counts them, and the pieces the pruned
    snapshot left are reused as stored (small pieces in packs are not asked about)."""
    with knobs.override(pack_bytes=0):
        yield


def test_a_snapshot_that_fills_the_disk_removes_the_chunks_it_wrote(
        disk: Path, caplog: pytest.LogCaptureFixture, chunk_objects: None) -> None:
    """A state larger than the disk: its final snapshot fails part-way. It left its chunks
    behind (the disk stayed full), and its last line said "the latest snapshot is step None";
    now the chunks it wrote go, those in the store before it stay (used by a committed snapshot
    or by none), and the line says what is true."""
    store = disk / "store"
    small, small_opt = model_opt(64, 64)
    with SnapshotManager("p", job="small", store=store, compression="off") as m:
        m.save(0, small, small_opt)
    before = chunk_files(store)
    # the same first 6 layers, saved then pruned: their chunks are in the store, unreferenced
    part, part_opt = model_opt(*[256] * 7)
    with SnapshotManager("p", job="part", store=store, compression="off") as m:
        info = m.save(0, part, part_opt)
    with Repository.open(store) as repo:
        prune_one(repo, info)
    orphans = chunk_files(store) - before
    big, big_opt = model_opt(*[256] * 21)  # 20 chunks of 256 KiB: more than the disk holds
    with caplog.at_level(logging.WARNING, "ciuic"):
        m = SnapshotManager("p", job="big", store=store, compression="off",
                            save_interval=1000)
        m.step(1, big, big_opt)
        m.close()  # its final snapshot, of step 1, fails: the disk is full
    said = caplog.text
    assert "no space left" in said and "the final snapshot at step 1 failed" in said, said
    assert "step None" not in said and "this run committed no snapshot" in said, said
    assert re.search(r"removed the failed snapshot's \d+ (chunk )?objects?", said), said
    # its own chunks went; those in the store before it stayed, though nothing uses them
    assert len(orphans) >= 6 and chunk_files(store) == before | orphans
    assert not [p for p in store.rglob(".tmp-*")]
    assert ciuic(store, "verify", "--deep").returncode == 0


def test_gc_runs_on_a_full_disk(disk: Path) -> None:
    """gc could not create its lock on a full disk ("creating .../locks/gc.json failed: no
    space left ... run ciuic prune and ciuic gc"): it now uses the little space the store holds
    in reserve for it, frees what pruned snapshots used, and takes the reserve back."""
    store = disk / "store"
    model, opt = model_opt(128, 128)
    with SnapshotManager("p", job="j", store=store, compression="off") as m:
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(1.0)
            m.save(step, model, opt)
    assert ciuic(store, "prune", "p/j", "--keep-last", "1").returncode == 0
    fill(disk)
    run = ciuic(store, "gc")
    assert run.returncode == 0, run.stderr
    assert re.search(r"deleted 2 chunks and 0 bodies", run.stdout), run.stdout
    assert (store / "objects" / ".locks" / "reserve").stat().st_size == RESERVE_BYTES
    assert ciuic(store, "verify", "--deep").returncode == 0


def test_gc_in_a_process_with_the_store_open_runs_on_a_full_disk(
        disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A training job's retention (its catalog open already) runs gc on a full disk: the lock
    and epoch are written in the store's reserve, which gc takes back once it freed space."""
    store = disk / "store"
    model, opt = model_opt(128, 128)
    with SnapshotManager("p", job="j", store=store, compression="off") as m:
        for step in range(3):
            with torch.no_grad():
                model.weight.add_(1.0)
            m.save(step, model, opt)
    with Repository.open(store) as repo:
        assert len(prune(repo, "p", "j", 1, None)) == 2
        fill(disk)
        with caplog.at_level(logging.WARNING, "ciuic"):
            result = collect(repo)
        assert result.deleted_chunks == 2 and not result.skipped
        assert "gc uses the space held in reserve" in caplog.text
    assert (store / "objects" / ".locks" / "reserve").stat().st_size == RESERVE_BYTES


def test_a_read_only_store_is_said_at_once_and_reindex_fails(disk: Path) -> None:
    store = disk / "store"
    model, opt = model_opt(64, 64)
    with SnapshotManager("p", job="j", store=store, compression="off") as m:
        for step in range(4):
            m.save(step, model, opt)
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, timeout=30)
    for args in (["prune", "p/j", "--keep-last", "1"], ["gc"]):
        run = ciuic(store, *args)
        lines = run.stderr.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, (args, run.stderr)
        assert "read-only file system; remount it read-write" in lines[0], lines
        assert "attempt" not in lines[0] and lines[0].count(str(disk)) == 1, lines
    assert re.search(r"p/j +4 +3 ", ciuic(store, "ls").stdout)  # nothing was pruned
    run = ciuic(store, "reindex")
    assert run.returncode == 2, run.stdout + run.stderr
    assert "read-only file system" in run.stderr and "nothing was written" in run.stderr
    assert "indexed" not in run.stdout
