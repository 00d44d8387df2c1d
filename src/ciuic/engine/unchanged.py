"""Copying host tensors into staging buffers, skipping the chunks that did not change.

A staging buffer still holds the bytes of the previous snapshot, and the writer hashed those
bytes chunk by chunk. So when staging copies a CPU tensor into its buffer, it first compares
each chunk of the live tensor with the same chunk of the buffer (``memcmp``, which runs at
memory speed, like the copy it replaces): an equal chunk is not copied, and its digest is the
one the writer computed last time, byte for byte the same input, so it is not hashed again
either. Only the chunks that differ are copied and, later, hashed. Compare and copy are one
pass over each range (:func:`copy_changed`).

This keeps the format's guarantee that every chunk's name is the BLAKE3 of its bytes: the
digest is reused only for bytes proven identical to the ones it was computed from, not guessed
from a cheaper fingerprint or a version counter (``tensor._version`` misses writes through
``.data`` or NumPy views).

Short ranges are copied with ``memmove``, not ``Tensor.copy_``: torch runs a copy of more
than 32 K elements as an OpenMP parallel region, whose barrier waits for every OpenMP thread to
be scheduled. On a host whose cores are busy (data-loader workers, another job) that wait
dominates a short copy: measured on the 2-core development VM under load, 64 MiB of 1-4 MiB
tensors took 0.10-0.13 s through ``copy_`` and 0.006-0.012 s through ``memmove``. Ranges of
:data:`LARGE_COPY_BYTES` or more go to the caller's ``copy_large`` (torch's vectorized copy on
all its threads, faster than ``memmove`` for them and not hurt by one barrier).

GPU tensors are copied by CUDA (their previous bytes are not on the device).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import TypeVar

import numpy as np
import torch

from ciuic.format import chunks as ck
from ciuic.threads import Pools

T = TypeVar("T")


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None)
        lib.memcmp.restype = ctypes.c_int
        lib.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.memmove.restype = ctypes.c_void_p
        lib.memmove.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        return lib
    except Exception:  # no C library to call (TypeError on Windows): torch copies
        return None


#: ``memcmp`` and ``memmove`` through ctypes, which releases the GIL around each call.
_LIBC = _libc()


def available() -> bool:
    return _LIBC is not None


def host_pointer(value: torch.Tensor | np.ndarray) -> int | None:
    """The address of ``value``'s raw bytes when they are laid out as the snapshot stores them
    (contiguous, little-endian, in host memory), else None."""
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous or value.dtype.byteorder == ">" or value.dtype.hasobject:
            return None
        return int(value.ctypes.data)
    if (value.is_cuda or value.device.type != "cpu" or value.layout != torch.strided
            or value.is_quantized or not value.is_contiguous() or value.is_conj()
            or value.is_neg()):
        return None
    return int(value.data_ptr())


#: Below this many bytes a tensor is copied on the calling thread alone: handing work to
#: another thread costs about as much as copying a few hundred KiB.
PARALLEL_MIN_BYTES = 2 * 1024 * 1024
#: A thread's range is at least this many bytes.
_MIN_PIECE = 1024 * 1024
#: Bytes of a chunk compared first, on the calling thread.
_FIRST_LOOK = 4096


def threads() -> int:
    """How many threads copy a large tensor at once: torch's intra-op thread count (its own
    copy would use as many), at most 8 (a few threads fill the memory bus)."""
    return max(1, min(8, torch.get_num_threads()))


_pools: Pools | None = None


def _pool() -> Pools:
    global _pools
    if _pools is None:
        _pools = Pools(max(1, threads() - 1), "ciuic-copy")
    return _pools


def _forget_pools() -> None:  # a forked child has none of its parent's threads
    global _pools
    _pools = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


#: Ranges at least this long are copied by the caller's ``copy_large`` (torch's ``copy_``,
#: vectorized and on all of torch's threads: 1 GiB in 0.068 s here, against 0.077 s for
#: ``memmove`` on two threads); shorter ones by ``memmove``, which does not pay for an OpenMP
#: region per copy.
LARGE_COPY_BYTES = 4 * 1024 * 1024

CopyRange = Callable[[int, int], None]  # (offset, bytes): copy that range, src -> dst


def copy_changed(src: int, dst: int, nbytes: int, chunk_bytes: int,
                 known: Sequence[str | None] | None, keep: object = None,
                 copy_large: CopyRange | None = None,
                 same: Collection[int] = ()) -> list[str | None] | None:
    """Make the ``nbytes`` at ``dst`` equal to those at ``src``, chunk by chunk.

    ``known[i]`` is the digest of chunk ``i`` of ``dst`` as it is now (None where unknown; no
    list: nothing known): such a chunk is compared first and copied only where it differs.
    Returns ``known[i]`` for the chunks whose bytes were equal, None for the others (None
    without ``known``).

    A large tensor is compared on several threads, in byte ranges of about equal size, one per
    thread (:func:`threads`; the caller takes the last range itself). The ranges that differ
    are copied with ``memmove`` where shorter than :data:`LARGE_COPY_BYTES`, else, once every
    thread is done, merged and handed to ``copy_large`` (on the calling thread; without it,
    ``memmove`` too). ``keep``: the objects that own the two memories, held until every range
    is done. Every range is done before this returns, even when it raises (an interrupt is
    re-raised after the others have finished), so no thread writes a buffer after its staging
    has returned.

    ``same``: chunks whose bytes at ``src`` are known to equal those at ``dst`` without
    comparing them (no page of them written since ``dst`` was made equal to ``src``:
    engine/written.py); those of them with a known digest are neither compared nor copied.
    """
    assert _LIBC is not None
    if nbytes <= chunk_bytes and (known is None or len(known) == 1):  # one chunk: no lists
        if known is not None and known[0] is not None and (
                0 in same or _LIBC.memcmp(src, dst, nbytes) == 0):
            return list(known)
        if copy_large is not None and nbytes >= LARGE_COPY_BYTES:
            copy_large(0, nbytes)
        else:
            _LIBC.memmove(dst, src, nbytes)
        return None if known is None else [None]
    if known is None and copy_large is not None:  # nothing to compare: one large copy
        copy_large(0, nbytes)
        return None
    chunks = ck.split(nbytes, chunk_bytes)
    if known is not None and len(known) != len(chunks):
        raise ValueError(f"{len(known)} digests for {len(chunks)} chunks")
    defer = copy_large is not None
    memcmp = _LIBC.memcmp
    pieces: list[Piece] = []  # what the threads do: compare, or copy a short piece
    large: list[tuple[int, int]] = []  # what copy_large does
    known_differ: set[int] = set()
    for i, (off, n) in enumerate(chunks):
        if i in same and known is not None and known[i] is not None:
            continue  # untouched since the bytes at dst were copied from it
        # a chunk that changed usually differs in its first page: found here, it needs no
        # thread (a training step changes every chunk of the tensors it updates)
        compare = (known is not None and known[i] is not None
                   and memcmp(src + off, dst + off, min(n, _FIRST_LOOK)) == 0)
        if not compare and known is not None:
            known_differ.add(i)
        if not compare and defer and n >= LARGE_COPY_BYTES:
            large.append((off, n))
        elif n:
            pieces.append((i, off, n, compare))
    work = sum(n for _, _, n, _ in pieces)
    parts = min(threads(), work // _MIN_PIECE) if work >= PARALLEL_MIN_BYTES else 1
    if parts <= 1:
        differ, more = _sync(src, dst, pieces, None, defer)
        large += more
    else:
        groups = _balance(pieces, work, parts)
        pool = _pool().get()
        futures: list[Future[tuple[set[int], list[tuple[int, int]]]]] = []
        try:
            for group in groups[:-1]:
                futures.append(pool.submit(_sync, src, dst, group, keep, defer))
            differ, more = _sync(src, dst, groups[-1], None, defer)
        finally:
            others = _finish(futures)
        large += more
        for other, more in others:
            differ |= other
            large += more
    differ |= known_differ
    if copy_large is not None:
        for off, n in _merged(large):
            copy_large(off, n)
    if known is None:
        return None
    return [None if i in differ else d for i, d in enumerate(known)]


Piece = tuple[int, int, int, bool]  # chunk index, offset, bytes, whether to compare first


def _sync(src: int, dst: int, pieces: Sequence[Piece], keep: object = None,
          defer: bool = False) -> tuple[set[int], list[tuple[int, int]]]:
    """Copy each piece from ``src`` to ``dst`` unless it is to be compared first and is equal.
    Returns the indices of the chunks that differ, and (``defer``) the ranges of
    :data:`LARGE_COPY_BYTES` or more left for the caller to copy."""
    assert _LIBC is not None
    memcmp, memmove = _LIBC.memcmp, _LIBC.memmove
    out: set[int] = set()
    large: list[tuple[int, int]] = []
    for i, off, n, compare in pieces:
        if compare and i not in out and memcmp(src + off, dst + off, n) == 0:
            continue
        out.add(i)
        if defer and n >= LARGE_COPY_BYTES:
            large.append((off, n))
        else:
            memmove(dst + off, src + off, n)
    return out, large


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, bytes) ranges with adjacent ones joined, in order."""
    out: list[tuple[int, int]] = []
    for off, n in sorted(ranges):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return out


def _finish(futures: Sequence[Future[T]]) -> list[T]:
    """Every future's result, waiting for all through interrupts (re-raised once all are
    done; so is the first error)."""
    out: list[T] = []
    deferred: BaseException | None = None
    for future in futures:
        while True:
            try:
                out.append(future.result())
                break
            except Exception as e:  # a range failed: re-raise its error after the others
                deferred = deferred or e
                break
            except BaseException as e:  # KeyboardInterrupt, SystemExit: wait on, then raise
                deferred = deferred or e
    if deferred is not None:
        raise deferred
    return out


def _balance(pieces: Sequence[Piece], total: int, parts: int) -> list[list[Piece]]:
    """``pieces`` regrouped into ``parts`` runs of about ``total / parts`` bytes each, cutting
    pieces where a run ends."""
    share = -(-total // parts)
    groups: list[list[Piece]] = [[]]
    room = share
    for i, off, n, compare in pieces:
        while n > 0:
            if room == 0:
                groups.append([])
                room = share
            take = min(n, room)
            groups[-1].append((i, off, take, compare))
            off, n, room = off + take, n - take, room - take
    return groups
