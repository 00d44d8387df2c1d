"""A store in a local directory: one file per object.

Durability: each object is written to a temporary file in its final directory, fsync'ed, then
renamed into place (``put``) or hard-linked into place (``create``, which fails if the name
exists: an atomic create-if-absent), and the directory is fsync'ed. Temporary files start with
``.tmp-`` and are never listed; a crash can leave them behind and ``gc`` removes them.

A full disk: the store holds :data:`RESERVE_BYTES` in ``.locks/reserve`` (never listed), which
``gc`` frees to write its lock when nothing else can be written, then takes back once it has
freed space (chain/gc.py).
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ciuic import knobs
from ciuic.errors import ObjectNotFound, StoreError
from ciuic.store import direct as dio
from ciuic.store.base import Data, Store, check_key, check_prefix, parts

_TMP = ".tmp-"
#: what a store holds in reserve for gc on a full disk: room to open the catalog beside it
#: (SQLite's 32 KiB shared-memory file) and to write gc's lock and epoch
RESERVE_BYTES = 128 * 1024
log = logging.getLogger("ciuic")


_SYNC_THREADS = 8
#: A local disk's write speed is measured once per file system and process, by writing this many
#: bytes (not zeros: some file systems compress) and fsync'ing them.
PROBE_BYTES = 256 * 1024 * 1024
_PROBE_BLOCK = 4 * 1024 * 1024
#: The probe's speeds are those of its fastest stretch of this many bytes (see ``_probe``).
PROBE_STRETCH = 32 * 1024 * 1024


def _fastest(times: list[float], block: int) -> float:
    """Bytes/s of the fastest run of :data:`PROBE_STRETCH` bytes, from each block's time."""
    per = max(1, PROBE_STRETCH // block)
    if len(times) < per:  # shorter than one stretch: the whole
        return len(times) * block / max(sum(times), 1e-6)
    fastest = min(sum(times[i:i + per]) for i in range(len(times) - per + 1))
    return per * block / max(fastest, 1e-6)
_speeds: dict[int, float] = {}  # st_dev -> bytes/s
_read_speeds: dict[int, float] = {}  # st_dev -> bytes/s of a cold read of the probe
_speeds_lock = threading.Lock()


_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
_WILLNEED_BYTES = 256 * 1024  # below this the kernel's own readahead covers the object


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes from a list of views (after a partial readv/writev)."""
    while views and n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
    if n:
        views[0] = views[0][n:]


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write every view, in order, with as few system calls as possible (writev)."""
    views = [v for v in views if len(v)]
    while views:
        _advance(views, os.writev(fd, views))


def _load_sync_file_range() -> Callable[[int], None]:
    """Linux's ``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)``: start writing a file's dirty
    pages to the disk now, without waiting (as RocksDB's ``bytes_per_sync`` does). A no-op
    elsewhere."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return lambda fd: None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start(fd: int) -> None:
        fn(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE; an error (a file system without it) is harmless

    return start


#: Chunks are written without fsync and made durable together by :meth:`LocalStore.sync`; each
#: one's writeback starts at once, so that the disk works while the writer hashes and encodes the
#: next ones, instead of sitting idle until the final fsync (with much free memory nothing else
#: starts it: 1 GiB of chunks became durable 35 % sooner on the development VM).
_start_writeback = _load_sync_file_range()


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def spare_room(objects: Path) -> bool:
    """Free the reserve of the local store in ``objects`` when its disk has less than
    :data:`RESERVE_BYTES` free, before a command that must run on a full disk (gc) opens its
    catalog and writes its lock. Whether it freed any."""
    try:
        if shutil.disk_usage(objects).free >= RESERVE_BYTES:
            return False
        (objects / ".locks" / "reserve").unlink()
    except OSError:
        return False
    log.warning("%s: the disk is full; gc uses the space held in reserve for it", objects)
    return True


class LocalStore(Store):
    """Objects as files under ``root``; keys map to relative paths."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root).expanduser().resolve()
        self.fsync = fsync
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the store directory {self.root}: {e}") from e
        self.url = f"file://{self.root}"
        self._known_dirs: set[Path] = set()
        self._pending: list[Path] = []
        #: directories made for writes not yet durable, whose entries in their parents are
        #: not synced yet either: sync() (or the next durable write under one) syncs them
        self._new_dirs: set[Path] = set()
        self._pending_lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        #: direct I/O for objects that line up (store/direct.py), until the file system or the
        #: device refuses it
        self.direct = True
        #: bytes written with direct I/O by this store object
        self.direct_bytes = 0
        self._reserved = False

    def write_speed(self, measure: bool = True) -> tuple[float, float | None]:
        """Measured: :data:`PROBE_BYTES` written and fsync'ed into the store's directory, once
        per file system and process (the writers share the disk: the speed is also the
        total); with ``measure=False`` only a speed measured before, else the default. Without
        fsync, writes go to memory: as fast as a copy."""
        if not self.fsync:
            return 1e11, None
        try:
            device = os.stat(self.root).st_dev
        except OSError:
            return self.write_bytes_per_s, None
        with _speeds_lock:
            if device not in _speeds:
                if not measure:
                    return self.write_bytes_per_s, None
                measured = self._probe()
                if measured is None:  # not remembered: the next snapshot tries again
                    return self.write_bytes_per_s, None
                _speeds[device], read = measured
                if read is not None:
                    _read_speeds[device] = read
            speed = _speeds[device]
        return speed, speed

    def read_speed(self) -> float | None:
        """A cold read of the write probe's file (dropped from the page cache first), once per
        file system and process; None until :meth:`write_speed` has measured."""
        if not self.fsync:
            return None
        try:
            device = os.stat(self.root).st_dev
        except OSError:
            return None
        with _speeds_lock:
            return _read_speeds.get(device)

    def _probe(self) -> tuple[float, float | None] | None:
        """(write, cold read) bytes/s of :data:`PROBE_BYTES`, written as chunks are (4 MiB
        writes, direct where the store writes direct; a probe through the page cache measured
        0.43-0.53 GB/s on the development VM, where direct chunk writes reach 1.6) and fsync'ed
        (the read None where the page cache could not be dropped for the file, or the read
        failed).

        A direct probe reports the speed of its fastest stretch of :data:`PROBE_STRETCH` bytes,
        as does the read: the probe runs while the job starts up (its first steps, the staging
        buffers being faulted in), which on the development VM made the whole probe read the
        disk at 0.43 GB/s where snapshots then wrote it at 0.8-1.1; a disk read as slow makes
        ``compression="auto"`` compress, which there doubled the time to durable. Erring fast
        errs towards raw chunks, which never slow a restore."""
        path = self.root / f"{_TMP}probe-{secrets.token_hex(8)}"
        block = mmap.mmap(-1, _PROBE_BLOCK)  # page-aligned: writable direct, as chunks are
        block[:] = os.urandom(_PROBE_BLOCK)
        try:
            times: list[float] = []
            t0 = time.perf_counter()
            fd, direct = dio.open_for(path, self.direct and knobs.get().direct_io)
            try:
                for _ in range(PROBE_BYTES // _PROBE_BLOCK):
                    t1 = time.perf_counter()
                    try:
                        os.write(fd, block)
                    except OSError as e:  # the device refuses this alignment: buffered
                        if not direct or e.errno != errno.EINVAL:
                            raise
                        dio.to_buffered(fd)
                        direct = False
                        os.write(fd, block)
                    times.append(time.perf_counter() - t1)
                os.fsync(fd)
            finally:
                os.close(fd)
            whole = PROBE_BYTES / max(time.perf_counter() - t0, 1e-6)
            write = max(whole, _fastest(times, _PROBE_BLOCK)) if direct else whole
            return write, self._cold_read(path)
        except OSError:
            return None
        finally:
            with contextlib.suppress(OSError):
                path.unlink()

    @staticmethod
    def _cold_read(path: Path) -> float | None:
        """Read a written, fsync'ed file back after asking the kernel to drop its pages, in the
        reads a restore makes (4 MiB, the whole file asked ahead): its fastest stretch."""
        dontneed = getattr(os, "POSIX_FADV_DONTNEED", None)
        if dontneed is None or _WILLNEED is None:
            return None
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, dontneed)
            buf = bytearray(_PROBE_BLOCK)
            times: list[float] = []
            os.posix_fadvise(fd, 0, 0, _WILLNEED)
            while True:
                t1 = time.perf_counter()
                n = os.readv(fd, [buf])
                if n < len(buf):  # the end (a short last block is not timed)
                    break
                times.append(time.perf_counter() - t1)
            return _fastest(times, _PROBE_BLOCK) if times else None
        except OSError:
            return None
        finally:
            os.close(fd)

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def _ensure_dir(self, directory: Path, durable: bool = True) -> None:
        """Create ``directory`` (and missing parents). Each new entry's parent is fsync'ed at
        once for a ``durable`` write, else by the :meth:`sync` that makes the write durable:
        a snapshot's first chunks into a fresh store make up to 256 prefix directories of one
        parent, one fsync instead of one each (on the VM, 0.8 s of its writer threads' time
        went to them). Either way a directory entry is durable before any file under it is."""
        if directory not in self._known_dirs:
            missing = []
            d = directory
            while not d.is_dir():
                missing.append(d)
                d = d.parent
            for d in reversed(missing):
                with contextlib.suppress(FileExistsError):
                    d.mkdir()
                if self.fsync:
                    if durable:
                        _fsync_path(d.parent)
                    else:
                        with self._pending_lock:
                            self._new_dirs.add(d)
            self._known_dirs.add(directory)
        if durable and self._new_dirs:
            self._sync_new_dirs(directory)

    def expect(self, prefixes: Iterable[str]) -> None:
        """Make the directories of ``prefixes`` (and their entries durable) now. A fresh
        store's first snapshot made its 256 chunk prefix directories as it wrote: each mkdir in
        a write thread, beside the writes (0.1-0.3 s of the write threads' time for the 1 GiB
        state on the development VM). The manager asks for them on its writer thread when it
        starts (manager/pipeline.py)."""
        dirs = [self._path(p.rstrip("/")) for p in prefixes]
        for d in dirs:
            self._ensure_dir(d, durable=False)
        with self._pending_lock:
            made = self._new_dirs & {a for d in dirs for a in (d, *d.parents)}
        if self.fsync:
            for parent in sorted({d.parent for d in made}, key=lambda p: len(p.parts)):
                _fsync_path(parent)  # the outermost first
        with self._pending_lock:
            self._new_dirs -= made

    def _sync_new_dirs(self, directory: Path) -> None:
        """Make durable the entries of ``directory`` and of its ancestors that writes not yet
        durable created (a durable write under them cannot wait for :meth:`sync`)."""
        with self._pending_lock:
            chain = [d for d in (directory, *directory.parents) if d in self._new_dirs]
        for d in reversed(chain):  # the outermost first
            _fsync_path(d.parent)
            with self._pending_lock:
                self._new_dirs.discard(d)

    def _write_tmp(self, path: Path, data: Data, sync: bool = True) -> Path:
        parent = path.parent
        self._ensure_dir(parent, durable=sync)
        tmp = parent / f"{_TMP}{secrets.token_hex(8)}"
        views = parts(data)
        pages = dio.plan(views) if self.direct and knobs.get().direct_io else None
        fd, direct = dio.open_for(tmp, pages is not None)
        try:
            if direct and pages is not None:
                wrote = dio.write(fd, pages)
                with self._pending_lock:
                    self.direct_bytes += wrote
                if not wrote:
                    self._refuse("the device refused the alignment of a direct write")
            else:
                if pages is not None:
                    self._refuse("the file system refused O_DIRECT")
                _write_all(fd, views)
            if self.fsync:
                if sync:
                    os.fsync(fd)
                else:
                    _start_writeback(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(fd)
        return tmp

    def _refuse(self, why: str) -> None:
        if self.direct:
            self.direct = False
            log.info("%s: writing %s through the page cache", why, self.root)

    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path, data, sync=durable)
            os.replace(tmp, path)
            if self.fsync and durable:
                _fsync_path(path.parent)
        except OSError as e:
            raise StoreError(f"cannot write {self.location(key)}: {e}") from e
        if self.fsync and not durable:
            with self._pending_lock:
                self._pending.append(path)

    def sync(self) -> None:
        """fsync every file written with ``durable=False``, then their directories, in parallel
        (one fsync each, overlapped: far cheaper than one at a time while writing)."""
        with self._pending_lock:
            files, self._pending = self._pending, []
            made, self._new_dirs = self._new_dirs, set()
        if not files and not made:
            return
        dirs = sorted({f.parent for f in files} | {d.parent for d in made})

        try:
            # (threads inherit the caller's priority, lowered or not)
            with ThreadPoolExecutor(_SYNC_THREADS, thread_name_prefix="ciuic-fsync") as pool:
                list(pool.map(_fsync_path, files))
                list(pool.map(_fsync_path, dirs))
        except OSError as e:
            with self._pending_lock:
                self._pending.extend(files)
                self._new_dirs |= made
            raise StoreError(f"cannot make writes under {self.root} durable: {e}") from e

    def create(self, key: str, data: Data) -> bool:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
            finally:
                with contextlib.suppress(OSError):
                    tmp.unlink()
            if self.fsync:
                _fsync_path(path.parent)
            return True
        except OSError as e:
            raise StoreError(f"cannot create {self.location(key)}: {e}") from e

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.location(key)} does not exist") from None
        except IsADirectoryError:
            raise ObjectNotFound(f"{self.location(key)} is not an object") from None
        except OSError as e:
            raise StoreError(f"cannot read {self.location(key)}: {e}") from e

    def get_into(self, key: str, buffers: list[memoryview], offset: int = 0) -> int:
        if offset < 0:
            raise ValueError(f"a read starts at an offset of 0 or more, not {offset}")
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ObjectNotFound(f"{self.location(key)} does not exist") from None
        except OSError as e:
            raise StoreError(f"cannot read {self.location(key)}: {e}") from e
        try:
            size = os.fstat(fd).st_size
            views = [memoryview(b).cast("B") for b in buffers if len(b)]
            wanted = min(sum(len(v) for v in views), max(0, size - offset))
            if _WILLNEED is not None and wanted > _WILLNEED_BYTES:
                # the whole range at once: the kernel reads it ahead while preadv copies the
                # first pages (a cold 1 GiB restore: 1.13 s against 1.36, medians of 8)
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, offset, wanted, _WILLNEED)
            at = offset
            while views:
                n = os.preadv(fd, views, at)
                if n == 0:
                    break
                at += n
                _advance(views, n)
            return size
        except OSError as e:
            raise StoreError(f"cannot read {self.location(key)}: {e}") from e
        finally:
            os.close(fd)

    def has(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        # Walk only the directory the prefix names, then filter by the full prefix.
        head, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        if not start.is_dir():
            return iter(())
        found: list[str] = []
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))  # .locks
            rel = Path(dirpath).relative_to(self.root).as_posix()
            base = "" if rel == "." else rel + "/"
            for name in filenames:
                if name.startswith(_TMP):
                    continue
                key = base + name
                if key.startswith(prefix):
                    found.append(key)
        return iter(sorted(found))

    def children(self, prefix: str) -> builtins.list[str]:
        check_prefix(prefix)
        if not prefix.endswith("/"):
            raise ValueError(f"children() takes a prefix that ends with '/', got {prefix!r}")
        start = self.root.joinpath(*prefix.rstrip("/").split("/"))
        if not start.is_dir():
            return []
        # (temporaries and the .locks folder start with a dot: no key does)
        return sorted(e.name for e in os.scandir(start) if not e.name.startswith("."))

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno == errno.EISDIR:
                return
            raise StoreError(f"cannot delete {self.location(key)}: {e}") from e

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """An advisory ``flock`` on ``<root>/.locks/<name>``: exclusive across processes on
        this machine (and on network filesystems that honour flock)."""
        check_key(name)
        path = self.root / ".locks" / (name.replace("/", "~") + ".lock")
        self._ensure_dir(path.parent)
        with self._thread_lock(name):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # closing releases the flock

    @property
    def _reserve(self) -> Path:  # (spare_room knows it too)
        return self.root / ".locks" / "reserve"

    def keep_reserve(self) -> None:
        """Hold :data:`RESERVE_BYTES` in reserve (best effort: a full or read-only disk holds
        none; checked once per store object once it holds them)."""
        if self._reserved:
            return
        with contextlib.suppress(OSError):
            if self._reserve.stat().st_size >= RESERVE_BYTES:
                self._reserved = True
                return
        try:
            self._reserve.parent.mkdir(exist_ok=True)
            fd = os.open(self._reserve, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                try:
                    os.posix_fallocate(fd, 0, RESERVE_BYTES)
                except OSError as e:  # a file system without fallocate: written (not zeros,
                    if e.errno in (errno.ENOSPC, errno.EDQUOT):  # which some compress)
                        raise
                    _write_all(fd, [memoryview(os.urandom(RESERVE_BYTES))])
            finally:
                os.close(fd)
            self._reserved = True
        except OSError:
            with contextlib.suppress(OSError):
                self._reserve.unlink()  # not a part of one: the next call tries again

    def release_reserve(self) -> bool:
        """Free the reserve (for gc, on a full disk); whether it held any."""
        self._reserved = False
        try:
            self._reserve.unlink()
        except OSError:
            return False
        return True

    def _thread_lock(self, name: str) -> threading.Lock:
        with self._pending_lock:
            return self._locks.setdefault(name, threading.Lock())

    def location(self, key: str = "") -> str:
        return str(self.root / key) if key else str(self.root)

    def remove_temporaries(self, older_than_s: float = 0.0) -> int:
        """Delete temporary files left by crashed writers (only those older than
        ``older_than_s``, so a concurrent writer's file is never pulled away). Returns how many."""
        n = 0
        cutoff = time.time() - older_than_s
        for dirpath, _, filenames in os.walk(self.root):
            for name in filenames:
                if name.startswith(_TMP):
                    path = os.path.join(dirpath, name)
                    with contextlib.suppress(OSError):
                        if os.stat(path).st_mtime <= cutoff:
                            os.unlink(path)
                            n += 1
        return n
