"""What bench/run.py measures with: the disk's floor, fsync, sizes on disk, the page cache,
host memory peaks, the copy floor of a stall, the machine, and the min/median/max summary."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from states import sync

Fn = Callable[[], None]


def disk_floor(base: Path, size: int) -> float:
    """The disk's raw write floor: ``size`` bytes in 64 MiB writes, then fsync (as dd does)."""
    path = base / "disk-floor.bin"
    block = b"\1" * (64 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def direct_floor(base: Path, size: int, threads: int = 1) -> float:
    """The disk's direct-write floor: ``size`` bytes in 4 MiB direct writes (no page cache,
    as ``dd oflag=direct``), then fsync. With one thread, one file written in order; with
    more, files of 4 MiB (as a writer of 4 MiB chunks makes) spread over ``threads``, each
    fsync'ed after all are written. Nothing is hashed or copied: no writer of every byte on
    this disk is faster. On a file system without direct I/O (tmpfs) the writes are buffered."""
    block = mmap.mmap(-1, 4 << 20)  # page-aligned, as O_DIRECT needs
    block.write(b"\1" * (4 << 20))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    where = base / "direct-floor"
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir()
    try:
        os.close(os.open(where / "probe", flags))
    except OSError:  # EINVAL: no direct I/O here
        flags &= ~getattr(os, "O_DIRECT", 0)
    (where / "probe").unlink(missing_ok=True)
    t0 = time.perf_counter()
    if threads == 1:
        fd = os.open(where / "floor.bin", flags)
        try:
            left = size
            while left > 0:
                left -= os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        def one(i: int) -> Path:
            path = where / f"{i:05d}"
            fd = os.open(path, flags)
            try:
                os.write(fd, block)
            finally:
                os.close(fd)
            return path

        with ThreadPoolExecutor(threads) as pool:
            paths = list(pool.map(one, range(-(-size // len(block)))))
            list(pool.map(fsync_path, [*paths, where]))
    elapsed = time.perf_counter() - t0
    shutil.rmtree(where)
    return elapsed


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for root, _, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(root, f))


def du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def evict(folder: Path) -> None:
    """Write back and drop every file under ``folder`` from the page cache (a cold read of it,
    without root and without emptying the rest of the cache)."""
    os.sync()
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def drop_caches() -> None:
    """Best effort: cold reads need root; otherwise reads are warm (said in the report)."""
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


class RssPeak:
    """Samples this process's RSS every few ms; ``extra`` is the peak over the start value."""

    def __init__(self) -> None:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_freed_memory() -> None:
    """Give freed heap memory back to the OS, so that RSS peaks measure each system alone."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def staging_floor(state: dict[str, torch.Tensor]) -> float:
    """The stall's floor: copying the state into buffers allocated beforehand."""
    cuda = any(v.is_cuda for v in state.values())  # device -> pinned host, as ciuic stages
    buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=cuda) for k, v in state.items()}
    for k, v in state.items():  # touch once, as reused buffers are
        buffers[k].copy_(v)
    sync(state)
    t0 = time.perf_counter()
    for k, v in state.items():
        buffers[k].copy_(v, non_blocking=cuda)
    sync(state)
    return time.perf_counter() - t0


def machine() -> dict[str, object]:
    """What the figures were measured on."""
    info: dict[str, object] = {"node": platform.node(), "cpus": os.cpu_count(),
                               "torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def timed(fn: Fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summary(xs: list[float]) -> str:
    return f"{min(xs):6.3f} / {statistics.median(xs):6.3f} / {max(xs):6.3f}"
