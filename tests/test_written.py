"""The kernel's write watch over host tensors (engine/written.py): every way a page can change
is reported, and snapshots that skip comparing unreported chunks miss no changed byte."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from ciuic import SnapshotManager, StateHolder, knobs
from ciuic.engine import written
from tests.test_unchanged import _raw, restored

WATCH = written.get()
needs_watch = pytest.mark.skipif(
    WATCH is None, reason="this kernel or process has no asynchronous userfaultfd "
    "write-protect with PAGEMAP_SCAN (Linux 6.7+): snapshots compare every tensor instead")
PAGE = written.PAGE
MADV_DONTNEED = 4


def _private(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


@contextlib.contextmanager
def _watched(nbytes: int = 64 * PAGE) -> Iterator[tuple[written.Watch, np.ndarray, int]]:
    """A watch over a mapping of its own (from malloc, the pages at either end of an array
    may hold other objects, whose writes the watch reports too: correct, not what is tested),
    forgotten after."""
    assert WATCH is not None
    a = np.frombuffer(_private(nbytes), dtype=np.float64)
    a[:] = 1.0
    assert WATCH.watch(a.ctypes.data, a.nbytes)
    try:
        yield WATCH, a, a.ctypes.data
    finally:
        WATCH.forget(a.ctypes.data, a.nbytes)


def _pages_of(ranges: list[tuple[int, int]], addr: int) -> set[int]:
    """The page numbers (from the page holding ``addr``) that ``ranges`` touch."""
    first = addr // PAGE
    return {(addr + off + k) // PAGE - first for off, n in ranges for k in (0, n - 1)}


def _write_through(how: str, a: np.ndarray, at: int) -> None:
    """Change the float64 at index ``at`` of ``a`` the way ``how`` says."""
    t = torch.from_numpy(a)
    if how == "numpy view":
        v = a[at:at + 1]
        v += 1
    elif how == "torch in place under no_grad":
        with torch.no_grad():
            t[at:at + 1].add_(1)
    elif how == ".data":
        t.data[at] = -3.0
    elif how == "another thread":
        th = threading.Thread(target=lambda: t[at:at + 1].mul_(5))
        th.start()
        th.join()
    elif how == "the kernel (readinto)":
        r, w = os.pipe()
        os.write(w, np.float64(7.5).tobytes())
        os.close(w)
        with os.fdopen(r, "rb") as f:
            assert f.readinto(memoryview(a[at:at + 1]).cast("B")) == 8
    elif how == "memmove":
        src = ctypes.c_double(9.25)
        ctypes.memmove(a.ctypes.data + 8 * at, ctypes.addressof(src), 8)
    else:
        raise AssertionError(how)


WAYS = ["numpy view", "torch in place under no_grad", ".data", "another thread",
        "the kernel (readinto)", "memmove"]


@needs_watch
@pytest.mark.parametrize("how", WAYS)
def test_every_way_of_writing_a_page_is_reported_once(how: str) -> None:
    with _watched() as (watch, a, addr):
        assert watch.written(addr, a.nbytes) == []
        before = a.copy()
        at = 10 * PAGE // 8 + 3  # in page 10 (or 11: the array need not start on a page)
        _write_through(how, a, at)
        assert not np.array_equal(a, before)
        got = watch.written(addr, a.nbytes)
        assert got is not None and _pages_of(got, addr) == {(addr + 8 * at) // PAGE
                                                              - addr // PAGE}, got
        assert watch.written(addr, a.nbytes) == []  # reported once: protected again


@needs_watch
def test_a_page_dropped_behind_the_watch_is_reported() -> None:
    """madvise(MADV_DONTNEED): the page reads as zeros from then on, without any write."""
    with _watched() as (watch, a, addr):
        page = (addr // PAGE + 20) * PAGE
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.madvise(ctypes.c_void_p(page), PAGE, MADV_DONTNEED) == 0
        assert a[(page - addr) // 8] == 0.0
        got = watch.written(addr, a.nbytes)
        assert got is not None and (page - addr, PAGE) in got


@needs_watch
def test_a_page_has_one_watcher_and_an_unwatched_range_is_unknown() -> None:
    with _watched() as (watch, a, addr):
        assert not watch.watch(addr + 8 * PAGE, PAGE)  # its scans would hide writes
        b = np.frombuffer(_private(PAGE), dtype=np.uint8)
        assert watch.written(b.ctypes.data, b.nbytes) is None  # never watched: unknown
    assert watch.written(addr, a.nbytes) is None  # forgotten: unknown, not "unwritten"
    assert watch.watch(addr, a.nbytes)  # and free to be watched again
    watch.forget(addr, a.nbytes)


@needs_watch
def test_shared_memory_and_a_files_pages_are_never_watched(tmp_path: Path) -> None:
    """Another process writes shared memory through page tables of its own; a private mapping
    of a file shows what others write to the file: no scan here would see those writes."""
    assert WATCH is not None
    shared = mmap.mmap(-1, 4 * PAGE)  # MAP_SHARED
    t = torch.zeros(4 * PAGE // 4).share_memory_()
    (tmp_path / "f").write_bytes(bytes(4 * PAGE))
    with open(tmp_path / "f", "r+b") as f:
        private_file = mmap.mmap(f.fileno(), 4 * PAGE, flags=mmap.MAP_PRIVATE)
    for addr in (ctypes.addressof(ctypes.c_char.from_buffer(shared)), t.data_ptr(),
                 ctypes.addressof(ctypes.c_char.from_buffer(private_file))):
        assert not WATCH.watch(addr, 4 * PAGE)
    mine = _private(4 * PAGE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mine))
    assert WATCH.watch(addr, 4 * PAGE)  # and private anonymous memory is
    WATCH.forget(addr, 4 * PAGE)


@needs_watch
def test_a_forked_child_has_a_watch_of_its_own() -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        ok = 0
        try:
            child = written.get()
            b = np.frombuffer(_private(8 * PAGE), dtype=np.float64)
            addr = b.ctypes.data
            if (child is not None and child is not WATCH and child.watch(addr, b.nbytes)
                    and child.written(addr, b.nbytes) == []):
                b[3 * PAGE // 8] = 2.0
                got = child.written(addr, b.nbytes)
                ok = int(got is not None and len(got) == 1)
        finally:
            os.write(w, bytes([ok]))
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"\x01"
    os.close(r)
    os.waitpid(pid, 0)


CHUNK = 64 * 1024


def _edits(rng: np.random.Generator) -> list[Callable[[dict[str, np.ndarray]], None]]:
    """Between two snapshots: one of the ways of writing, at a random place of a random tensor,
    or nothing (most often: the watch then lets every chunk of them pass)."""
    def edit(live: dict[str, np.ndarray]) -> None:
        name = str(rng.choice(sorted(live)))
        a = live[name]
        _write_through(str(rng.choice(WAYS)), a, int(rng.integers(0, a.size)))
    return [edit] if rng.random() < 0.5 else []


@pytest.mark.parametrize("watching", [True, False], ids=["watched", "compared"])
def test_snapshots_that_trust_the_watch_restore_every_change(store_dir: Path,
                                                             watching: bool) -> None:
    """Twenty snapshots of three 2 MiB tensors that rarely change, in every way a page can be
    written: every snapshot restores to the bytes of its call, with the watch (which lets the
    chunks it saw no write to pass without comparing them) and without it."""
    if watching and WATCH is None:
        pytest.skip("no write watch on this kernel (see needs_watch)")
    rng = np.random.default_rng(11)
    live = {f"t{i}": np.random.default_rng(i).standard_normal(2 * 1024 * 1024 // 8)
            for i in range(3)}
    wanted: list[tuple[str, dict[str, bytes]]] = []
    with knobs.override(chunk_bytes=CHUNK, write_watch=watching), SnapshotManager(
            "p", job="watch", store=store_dir, compression="off") as m:
        for step in range(20):
            for edit in _edits(rng):
                edit(live)
            info = m.save(step, state=StateHolder(live))
            wanted.append((info.id, {k: v.tobytes() for k, v in live.items()}))
        skipped = m._pipeline.staging.watched.skipped_bytes
        for sid, want in wanted:
            got = restored(m, snapshot=sid)
            assert {k: _raw(v) for k, v in got.items()} == want, sid
    if watching:  # the watch was used: most chunks of most snapshots were not compared
        assert skipped > 10 * 3 * 2 * 1024 * 1024, skipped
    else:
        assert skipped == 0
