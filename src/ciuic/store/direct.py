"""Direct I/O (``O_DIRECT``) for the local store's large objects.

A buffered write copies every byte into the page cache, and the kernel then writes the cache to
the disk. For a snapshot's chunks that copy is the largest cost of a save: ``perf`` put 65 % of
a full 1 GiB snapshot's samples in the kernel's ``copy_folio_from_iter_atomic`` on the
development VM, and the page-cache pages it allocates made the time to durable swing 3x from
round to round (docs/benchmarks.md, "Direct I/O"). A direct write hands the buffer to the disk
as it is: no copy, no page cache.

A direct write needs the memory address, the file offset and the length to be multiples of the
device's block size. A raw chunk is a 16-byte header, then the piece; the staging buffers are
laid out so that each piece starts 16 bytes past a page boundary
(:func:`ciuic.engine.staging.allocate_host`), so that the header and the piece's first
4080 bytes fill one page, copied into a small page-aligned buffer, and the rest of the piece
lies on page boundaries. The object is written as:

- the first page (the header and the start of the piece), from the per-thread page;
- the piece's whole pages, straight from its memory;
- the last partial page, buffered (the file's offset then stays aligned, and no block is read
  back to be zeroed, as a truncation would).

Pages (4 KiB) satisfy any device whose logical blocks are at most 4 KiB. Objects that do not
line up (sealed or compressed chunks, bodies, a piece from a tensor the writer did not stage)
are written buffered, as is everything on a file system that refuses ``O_DIRECT`` (tmpfs).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading

#: Offsets, lengths and addresses of direct writes are multiples of this.
BLOCK = 4096
#: Smaller objects are written buffered: the page cache's copy costs little for them, and a
#: direct write of a few pages waits on the disk.
MIN_BYTES = 1 << 20
FLAG: int = getattr(os, "O_DIRECT", 0)

_local = threading.local()


def address(view: memoryview) -> int | None:
    """The address of a writable, contiguous buffer's first byte (None for a read-only one)."""
    if view.readonly or not view.c_contiguous or not len(view):
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _first_page() -> mmap.mmap:
    page = getattr(_local, "page", None)
    if page is None:
        page = _local.page = mmap.mmap(-1, BLOCK)  # page-aligned
    return page


def plan(views: list[memoryview]) -> tuple[memoryview, memoryview, memoryview] | None:
    """How ``views`` (an object's bytes, back to back) can be written with direct I/O: (its
    first page, copied into this thread's page; its whole pages after that, in place; the
    rest), or None where they do not line up.

    They line up when every view but the last holds fewer than :data:`BLOCK` bytes in all, and
    the last one's memory continues them on page boundaries (its byte ``BLOCK - head`` starts a
    page)."""
    if not FLAG or not views:
        return None
    last = views[-1]
    head = sum(len(v) for v in views[:-1])
    lead = BLOCK - head
    if lead <= 0 or head + len(last) < MIN_BYTES:
        return None
    start = address(last)
    if start is None or (start + lead) % BLOCK:
        return None
    body = (len(last) - lead) // BLOCK * BLOCK
    page = _first_page()
    page[:head] = b"".join(views[:-1])
    page[head:] = last[:lead]
    return memoryview(page), last[lead:lead + body], last[lead + body:]


def open_for(path: str | os.PathLike[str], direct: bool) -> tuple[int, bool]:
    """A new file at ``path``, opened for direct I/O where ``direct`` and the file system
    allows it. Returns (fd, whether it is direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    if direct and FLAG:
        try:
            return os.open(path, flags | FLAG, 0o644), True
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this file system has no direct I/O
                raise
    return os.open(path, flags, 0o644), False


def to_buffered(fd: int) -> None:
    """Turn direct I/O off for ``fd``: its next writes go through the page cache."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~FLAG)


def write(fd: int, pages: tuple[memoryview, memoryview, memoryview]) -> int:
    """Write a :func:`plan` to ``fd`` (opened direct, at offset 0): the aligned part direct,
    then the rest buffered. Returns the bytes written direct: 0 where the device refused the
    alignment (EINVAL), and the whole object went buffered."""
    first, body, rest = pages
    aligned = [first, body]
    size = sum(len(v) for v in aligned)
    done = 0
    try:
        while done < size:
            n = os.pwritev(fd, _skip(aligned, done), done)
            if n <= 0 or n % BLOCK:  # a short write that broke the alignment: finish buffered
                done += max(n, 0)
                break
            done += n
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    direct = done
    to_buffered(fd)
    tail = _skip([*aligned, rest], done)
    while tail:
        n = os.pwritev(fd, tail, done)
        done += n
        tail = _skip(tail, n)
    return direct


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes (and without empty views)."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out
