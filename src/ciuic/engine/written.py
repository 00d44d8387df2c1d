"""Which pages of host memory were written since a snapshot last looked (Linux 6.7 and later).

A later snapshot compares each chunk of a host tensor with its staging buffer (engine/
unchanged.py) to find the chunks that did not change. For a state whose largest part never
changes (a frozen base under LoRA, embeddings of unused rows) that comparison is most of the
snapshot: 1 GiB compared is 0.08 s on the development VM. The kernel can say instead which of
those pages were written at all.

A :class:`Watch` holds a userfaultfd in *asynchronous write-protect* mode
(``UFFD_FEATURE_WP_ASYNC``): protecting a range sets a bit in each of its page-table entries;
the first write to a page after that, by any means (Python, NumPy, torch, another thread, the
kernel's own ``read`` into the memory), clears the bit as the kernel resolves the fault itself,
without waking anyone. ``PAGEMAP_SCAN`` on ``/proc/self/pagemap`` then lists the pages whose
bit is clear, written, and sets it again on them in the same walk (``PM_SCAN_WP_MATCHING``):
no write between two scans can go unreported. A scan of 1 GiB that nothing wrote takes well
under a millisecond.

What it cannot see, and how that is handled:

- Memory that is not private anonymous memory (shared memory, which another process writes
  through page tables of its own; a file's pages; CUDA's page-locked buffers): never watched
  (``/proc/self/maps`` says which), the tensor is compared as before.
- Writes by a device straight into memory (DMA): they bypass the page tables. A tensor
  page-locked for CUDA is never watched (``is_pinned``).
- A page dropped behind the watch's back (``madvise(MADV_DONTNEED)``: its bytes read as zeros
  from then on, without a write): every scan also asks which pages are neither present nor
  swapped out, and reports them written.
- A range the process unmapped and mapped again: the new mapping is not registered, the scan
  fails (``PM_SCAN_CHECK_WPASYNC``), and the whole range counts as written.

Where the kernel lacks any of this (before 6.7, another architecture, ``/proc`` not mounted, a
seccomp policy), :func:`get` returns None once and every tensor is compared as before. Opening
the userfaultfd asks for ``UFFD_USER_MODE_ONLY``, which an unprivileged process may do where
``vm.unprivileged_userfaultfd`` is 0 (the default); the write-protect in asynchronous mode
never delivers a fault to anyone, so kernel-mode writes are resolved (and seen) all the same.

Every watched write costs one minor fault per page (2.6 us on the VM) the first time after a
scan: the staging area watches only tensors a full comparison has just found unchanged, and
stops watching (unregisters, which clears the marks) one that turns out to be written.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import errno
import logging
import os
import platform
import threading
from dataclasses import dataclass

from ciuic import knobs

log = logging.getLogger("ciuic")

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

# <linux/userfaultfd.h>
_UFFD_API = 0xAA
_UFFD_USER_MODE_ONLY = 1
_FEATURE_WP_UNPOPULATED = 1 << 13  # protecting an untouched page protects it too
_FEATURE_WP_ASYNC = 1 << 15
_REGISTER_MODE_WP = 1 << 1
_WRITEPROTECT_MODE_WP = 1 << 0


def _iowr(nr: int, size: int, kind: int = _UFFD_API) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


_UFFDIO_API = _iowr(0x3F, 24)
_UFFDIO_REGISTER = _iowr(0x00, 32)
_UFFDIO_UNREGISTER = (2 << 30) | (16 << 16) | (_UFFD_API << 8) | 0x01
_UFFDIO_WRITEPROTECT = _iowr(0x06, 24)
_USERFAULTFD_IOC_NEW = (_UFFD_API << 8) | 0x00  # /dev/userfaultfd
# <linux/fs.h>: PAGEMAP_SCAN and struct pm_scan_arg (12 x u64)
_PAGEMAP_SCAN = _iowr(16, 96, ord("f"))
_PM_SCAN_WP_MATCHING, _PM_SCAN_CHECK_WPASYNC = 1 << 0, 1 << 1
_PAGE_IS_WRITTEN, _PAGE_IS_PRESENT, _PAGE_IS_SWAPPED = 1 << 1, 1 << 3, 1 << 4
#: the userfaultfd system call's number by machine
_SYSCALL = {"x86_64": 323, "aarch64": 282}
#: regions a scan returns at once (each a start, an end and its categories)
_REGIONS = 256

Ranges = list[tuple[int, int]]  # (offset, bytes), relative to the watched address


class Watch:
    """Write-protect watches over ranges of this process's memory (one userfaultfd)."""

    def __init__(self, uffd: int, pagemap: int) -> None:
        self._uffd, self._pagemap = uffd, pagemap
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._lock = threading.Lock()
        self._vec = (ctypes.c_uint64 * (3 * _REGIONS))()
        #: the page ranges watched, start -> end: never two over one page, since a scan
        #: protects again what it reports, and a second watcher of that page would miss it
        self._ranges: dict[int, int] = {}

    @classmethod
    def open(cls) -> Watch:
        """A watch; raises OSError where this kernel or process cannot have one."""
        libc = ctypes.CDLL(None, use_errno=True)
        uffd = -1
        try:
            dev = os.open("/dev/userfaultfd", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            dev = -1
        if dev >= 0:
            try:
                uffd = libc.ioctl(dev, _USERFAULTFD_IOC_NEW, os.O_CLOEXEC | os.O_NONBLOCK)
            finally:
                os.close(dev)
        if uffd < 0:
            number = _SYSCALL.get(platform.machine())
            if number is None:
                raise OSError(errno.ENOSYS, f"no userfaultfd number for {platform.machine()}")
            uffd = libc.syscall(number, os.O_CLOEXEC | os.O_NONBLOCK | _UFFD_USER_MODE_ONLY)
            if uffd < 0:
                e = ctypes.get_errno()
                raise OSError(e, f"userfaultfd: {os.strerror(e)}")
        try:
            want = _FEATURE_WP_ASYNC | _FEATURE_WP_UNPOPULATED
            api = (ctypes.c_uint64 * 3)(_UFFD_API, want, 0)
            if libc.ioctl(uffd, _UFFDIO_API, api) < 0:
                e = ctypes.get_errno()
                raise OSError(e, f"UFFDIO_API (asynchronous write-protect): {os.strerror(e)}")
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            os.close(uffd)
            raise
        watch = cls(uffd, pagemap)
        try:
            watch._probe()
        except BaseException:
            watch.close()
            raise
        return watch

    def _probe(self) -> None:
        """Protect a page, write it, and see the scan report it (PAGEMAP_SCAN: Linux 6.7)."""
        buf = ctypes.create_string_buffer(3 * PAGE)
        addr = (ctypes.addressof(buf) + PAGE - 1) // PAGE * PAGE
        if not self.watch(addr, PAGE):
            raise OSError(errno.EINVAL, "could not register a page of the heap")
        try:
            if self.written(addr, PAGE) is None:
                raise OSError(errno.EINVAL, "PAGEMAP_SCAN failed")
            ctypes.memset(addr, 1, 1)
            if self.written(addr, PAGE) != [(0, PAGE)]:
                raise OSError(errno.EINVAL, "PAGEMAP_SCAN did not report a written page")
        finally:
            self.forget(addr, PAGE)

    def close(self) -> None:
        for fd in (self._uffd, self._pagemap):
            with contextlib.suppress(OSError):
                os.close(fd)

    @staticmethod
    def _pages(addr: int, nbytes: int) -> tuple[int, int]:
        start = addr // PAGE * PAGE
        return start, -(-(addr + nbytes) // PAGE) * PAGE

    def watch(self, addr: int, nbytes: int, maps: Maps | None = None) -> bool:
        """Start watching the pages that hold ``[addr, addr + nbytes)``: from now on a scan
        reports every write to them. False where this memory cannot be watched, or a page of
        it is watched already (by anyone in this process). ``maps``: :func:`read_maps`, read
        since the memory was allocated (by default now)."""
        start, end = self._pages(addr, nbytes)
        reg = (ctypes.c_uint64 * 4)(start, end - start, _REGISTER_MODE_WP, 0)
        if not _private_anonymous(start, end, read_maps() if maps is None else maps):
            return False
        with self._lock:
            if any(s < end and start < e for s, e in self._ranges.items()):
                return False
            if self._libc.ioctl(self._uffd, _UFFDIO_REGISTER, reg) < 0:
                log.debug("cannot watch %#x+%d for writes: %s", addr, nbytes,
                          os.strerror(ctypes.get_errno()))
                return False
            wp = (ctypes.c_uint64 * 3)(start, end - start, _WRITEPROTECT_MODE_WP)
            if self._libc.ioctl(self._uffd, _UFFDIO_WRITEPROTECT, wp) < 0:
                log.debug("write-protect %#x+%d: %s", start, end - start,
                          os.strerror(ctypes.get_errno()))
                self._unregister(start, end)
                return False
            self._ranges[start] = end
            return True

    def _unregister(self, start: int, end: int) -> None:
        """Unregister the pages (which clears their marks: 0.3 ms for 16 MiB); memory already
        unmapped is fine."""
        rng = (ctypes.c_uint64 * 2)(start, end - start)
        self._libc.ioctl(self._uffd, _UFFDIO_UNREGISTER, rng)

    def forget(self, addr: int, nbytes: int) -> None:
        """Stop watching (writes then cost nothing more); memory already unmapped is fine."""
        start, end = self._pages(addr, nbytes)
        with self._lock:
            if self._ranges.pop(start, None) is not None:
                self._unregister(start, end)

    def written_pages(self, addr: int, nbytes: int, most: int) -> int | None:
        """How many pages of the range were written since the last scan, counted up to
        ``most`` + 1 (the walk stops there), without protecting them again. None: unknown."""
        start, end = self._pages(addr, nbytes)
        with self._lock:
            found = self._scan(start, end, _PM_SCAN_CHECK_WPASYNC, 0, _PAGE_IS_WRITTEN,
                               most + 1)
        if found is None:
            return None
        return sum(hi - lo for lo, hi in found) // PAGE

    def written(self, addr: int, nbytes: int) -> Ranges | None:
        """The byte ranges of ``[addr, addr + nbytes)`` (relative to ``addr``) whose pages
        were written since the last scan or :meth:`watch`, or dropped; their pages are
        protected again in the same walk. None: the scan failed (count everything written)."""
        start, end = self._pages(addr, nbytes)
        with self._lock:
            written = self._scan(start, end, _PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC,
                                 0, _PAGE_IS_WRITTEN)
            # pages neither present nor swapped out (nor protected while untouched: those
            # are swap-like entries): dropped, reading as zeros without having been written
            gone = self._scan(start, end, 0, _PAGE_IS_PRESENT | _PAGE_IS_SWAPPED,
                              _PAGE_IS_PRESENT | _PAGE_IS_SWAPPED)
        if written is None or gone is None:
            return None
        out: Ranges = []
        for lo, hi in sorted(written + gone):
            lo, hi = max(lo, addr) - addr, min(hi, addr + nbytes) - addr
            if hi <= lo:
                continue
            if out and lo <= out[-1][0] + out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][0] + out[-1][1], hi) - out[-1][0])
            else:
                out.append((lo, hi - lo))
        return out

    def _scan(self, start: int, end: int, flags: int, inverted: int, mask: int,
              most: int = 0) -> list[tuple[int, int]] | None:
        """The regions of ``[start, end)`` whose pages match; ``most``: stop after that many
        pages (0: no limit)."""
        found: list[tuple[int, int]] = []
        vec = self._vec
        while start < end:
            left = most - sum(hi - lo for lo, hi in found) // PAGE if most else 0
            if most and left <= 0:
                break
            arg = (ctypes.c_uint64 * 12)(96, flags, start, end, 0, ctypes.addressof(vec),
                                         _REGIONS, left, inverted, mask, 0, mask)
            n = self._libc.ioctl(self._pagemap, _PAGEMAP_SCAN, arg)
            if n < 0:
                log.debug("PAGEMAP_SCAN %#x-%#x: %s", start, end,
                          os.strerror(ctypes.get_errno()))
                return None
            found += [(vec[3 * i], vec[3 * i + 1]) for i in range(n)]
            walked = arg[4]  # walk_end: where the walk stopped (the end, or a full vector)
            if walked <= start:
                return None
            start = walked
        return found


Maps = list[tuple[int, int, bool]]  # (start, end, private anonymous), in address order


def read_maps() -> Maps:
    """This process's mappings (``/proc/self/maps``); empty where it cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out: Maps = []
    for line in lines:
        fields = line.split(maxsplit=5)
        lo, _, hi = fields[0].partition(b"-")
        out.append((int(lo, 16), int(hi, 16), fields[1][3:4] == b"p" and fields[4] == b"0"))
    return out


def _private_anonymous(start: int, end: int, maps: Maps) -> bool:
    """Whether ``[start, end)`` lies in private anonymous mappings only. Not shared memory
    (``share_memory_()``, a ``MAP_SHARED`` mapping: another process writes it through page
    tables of its own, which no scan here sees) nor a file's pages (a private mapping of a
    file shows what others write to the file until this process writes the page)."""
    at = start
    for lo, hi, private in maps[max(0, bisect.bisect_right(maps, (start, 2**64)) - 1):]:
        if hi <= at:
            continue
        if lo > at or not private:
            return False
        at = hi
        if at >= end:
            return True
    return False


#: Tensors smaller than this are compared, not watched (each watched range is a mapping of
#: its own in the kernel; comparing 1 MiB takes about 0.1 ms)
WATCH_MIN_BYTES = 1024 * 1024


@dataclass
class _Entry:
    addr: int
    nbytes: int
    #: the staging buffer was made equal to this memory after the watch began (the last
    #: scan, or :meth:`Watch.watch`): only then may an unreported chunk skip its comparison
    armed: bool = False
    #: chunks with a page the last scan reported written (equal bytes or not)
    touched: int = 0


class Tracker:
    """The watched host tensors of one staging area, by path.

    A tensor is watched from the snapshot after one that found it entirely unchanged; its
    pages are protected before that snapshot compares it, so a write at any time after is
    reported. From the next snapshot on, the chunks with no page reported are neither compared
    nor copied (their digests reused); the others are compared as before. A tensor written in
    more than a quarter of its chunks between two snapshots (if only to equal bytes) is no
    longer watched: a write to a protected page costs a minor fault.
    """

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._steady: set[str] = set()  # found entirely unchanged by their last copy
        #: the process's mappings, read once a snapshot (its tensors live through it, so
        #: their mappings cannot change; reading them costs about a millisecond)
        self._maps: Maps | None = None
        #: bytes the last snapshots did not compare because no page of them was written
        self.skipped_bytes = 0

    def new_snapshot(self) -> None:
        """A snapshot's staging begins: the mappings are read again when needed."""
        self._maps = None

    def before(self, path: str, value: object, ptr: int, nbytes: int,
               chunks: list[tuple[int, int]]) -> tuple[_Entry | None, frozenset[int]]:
        """Right before ``value`` (at ``ptr``, split into ``chunks``) is copied to its staging
        buffer: its watch entry (to pass to :meth:`after`) and the indices of the chunks no
        write has touched since the buffer was last made equal to it."""
        entry = self._entries.get(path)
        if entry is not None and (entry.addr, entry.nbytes) != (ptr, nbytes):
            self.drop(path)  # another tensor, or the memory moved
            entry = None
        watch = get() if (knobs.get().write_watch and nbytes >= WATCH_MIN_BYTES
                          and _may_watch(value)) else None
        if watch is None:
            if entry is not None:
                self.drop(path)
            return None, frozenset()
        if entry is None:
            if path in self._steady:
                if self._maps is None:
                    self._maps = read_maps()
                if watch.watch(ptr, nbytes, self._maps):
                    entry = self._entries[path] = _Entry(ptr, nbytes)
            return entry, frozenset()
        pages = -(-nbytes // PAGE)
        many = watch.written_pages(ptr, nbytes, pages // 4)
        if many is None or 4 * many > pages:  # written all over: stop watching (no walk
            self.drop(path)                      # protecting every page again)
            return None, frozenset()
        ranges = watch.written(ptr, nbytes)  # protects again: every later write is seen
        armed, entry.armed = entry.armed, False
        if ranges is None:
            entry.touched = len(chunks)
            return entry, frozenset()
        same = frozenset(i for i, (off, n) in enumerate(chunks)
                         if not any(lo < off + n and off < lo + size for lo, size in ranges))
        entry.touched = len(chunks) - len(same)
        if not armed:
            return entry, frozenset()
        self.skipped_bytes += sum(chunks[i][1] for i in same)
        return entry, same

    def after(self, path: str, entry: _Entry | None, kept: list[str | None] | None) -> None:
        """After the copy: ``kept`` as :func:`~ciuic.engine.unchanged.copy_changed` returned
        it (the digests of the chunks that were equal)."""
        changed = sum(d is None for d in kept) if kept is not None else 0
        if kept is not None and changed == 0:
            self._steady.add(path)
        else:
            self._steady.discard(path)
        if entry is None:
            return
        if kept is None or 4 * max(entry.touched, changed) > len(kept):
            self.drop(path)  # written all over (if to equal bytes): a fault a page, for little
        else:
            entry.armed = True

    def drop(self, path: str) -> None:
        entry = self._entries.pop(path, None)
        watch = _watch
        if entry is not None and watch is not None:
            watch.forget(entry.addr, entry.nbytes)

    def clear(self) -> None:
        for path in list(self._entries):
            self.drop(path)
        self._steady.clear()


def _may_watch(value: object) -> bool:
    """Whether a write into ``value`` goes through the page tables: not where CUDA may copy
    into it directly (memory page-locked for it)."""
    import torch

    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return True
    return isinstance(value, torch.Tensor) and not value.is_pinned()


_watch: Watch | None = None
_tried = False
_open_lock = threading.Lock()


def get() -> Watch | None:
    """This process's watch, opened at the first call; None where the kernel or the process
    cannot have one (said once, at debug level)."""
    global _watch, _tried
    if _tried:
        return _watch
    with _open_lock:
        if not _tried:
            try:
                _watch = Watch.open()
            except OSError as e:
                log.debug("no write watch (each unchanged tensor is compared instead): %s", e)
            _tried = True
    return _watch


def _forget_after_fork() -> None:  # a child's memory is not its parent's userfaultfd's
    global _watch, _tried
    if _watch is not None:
        _watch.close()
    _watch, _tried = None, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)

