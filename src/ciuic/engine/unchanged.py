"""Finding the chunks of a tensor that did not change since the last snapshot, while staging.

A staging buffer still holds the bytes of the previous snapshot, and the writer hashed those
bytes chunk by chunk. So when staging copies a CPU tensor into its buffer, it first compares
each chunk of the live tensor with the same chunk of the buffer (``memcmp`` on several
threads, which runs at memory speed, like the copy it replaces): an equal chunk is not copied,
and its digest is the one the writer computed last time, byte for byte the same input, so it is
not hashed again either. Only the chunks that differ are copied and, later, hashed.

This keeps the format's guarantee that every chunk's name is the BLAKE3 of its bytes: the
digest is reused only for bytes proven identical to the ones it was computed from, not guessed
from a cheaper fingerprint or a version counter (``tensor._version`` misses writes through
``.data`` or NumPy views). Measured on the 2-core development machine: comparing 1 GiB takes
0.069 s on one thread, 0.061 s on two, copying it 0.069 s; an incremental snapshot no longer
hashes the whole state.

GPU tensors are always copied (their previous bytes are not on the device).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence

import numpy as np
import torch

from .. import chunks as ck
from .background import Pools


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None)
        lib.memcmp.restype = ctypes.c_int
        lib.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        return lib
    except Exception:  # no C library to call (TypeError on Windows): every chunk is copied
        return None


#: ``memcmp`` through ctypes, which releases the GIL around each call.
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
    if (value.is_cuda or value.device.type != "cpu" or not value.is_contiguous()
            or value.is_conj() or value.is_neg()):
        return None
    return int(value.data_ptr())


#: Below this many bytes a tensor is compared on the calling thread alone: handing work to
#: another thread costs about as much as comparing a few hundred KiB.
PARALLEL_MIN_BYTES = 2 * 1024 * 1024
#: Pieces a chunk is cut into at most are no smaller than this.
_MIN_PIECE = 1024 * 1024


def threads() -> int:
    """How many threads compare at once: torch's intra-op thread count (the copy it replaces
    uses as many), at most 8 (``memcmp`` reads two streams; a few threads fill the memory bus)."""
    return max(1, min(8, torch.get_num_threads()))


_pools: Pools | None = None


def _pool() -> Pools:
    global _pools
    if _pools is None:
        _pools = Pools(max(1, threads() - 1), "ciuic-compare")
    return _pools


def _forget_pools() -> None:  # a forked child has none of its parent's threads
    global _pools
    _pools = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def still_equal(src: int, dst: int, nbytes: int, chunk_bytes: int,
                known: Sequence[str | None]) -> list[str | None]:
    """Compare the ``nbytes`` at ``src`` with those at ``dst``, chunk by chunk.

    ``known[i]`` is the digest of chunk ``i`` of ``dst`` (None where unknown: not compared).
    Returns ``known[i]`` for the chunks whose bytes are equal, None for the others.

    A large tensor is cut into byte ranges of about equal size, one per thread
    (:func:`threads`; the caller compares the last range itself): one thread's ``memcmp`` runs
    at the speed of one thread's copy, while the copy it replaces runs on all of torch's.
    """
    assert _LIBC is not None
    chunks = ck.split(nbytes, chunk_bytes)
    if len(known) != len(chunks):
        raise ValueError(f"{len(known)} digests for {len(chunks)} chunks")
    todo = [(i, off, n) for i, ((off, n), d) in enumerate(zip(chunks, known, strict=True))
            if d is not None]
    total = sum(n for _, _, n in todo)
    parts = min(threads(), total // _MIN_PIECE) if total >= PARALLEL_MIN_BYTES else 1
    if parts <= 1:
        differ = _differ(src, dst, todo)
    else:
        groups = _balance(todo, total, parts)
        pool = _pool().get()
        futures = [pool.submit(_differ, src, dst, group) for group in groups[:-1]]
        differ = _differ(src, dst, groups[-1])
        for future in futures:
            differ |= future.result()
    return [None if i in differ else d for i, d in enumerate(known)]


def _differ(src: int, dst: int, pieces: Sequence[tuple[int, int, int]]) -> set[int]:
    """The chunk indices among ``pieces`` (chunk index, offset, bytes) whose bytes differ."""
    assert _LIBC is not None
    memcmp = _LIBC.memcmp
    out: set[int] = set()
    for i, off, n in pieces:
        if i not in out and memcmp(src + off, dst + off, n) != 0:
            out.add(i)
    return out


def _balance(pieces: Sequence[tuple[int, int, int]], total: int,
             parts: int) -> list[list[tuple[int, int, int]]]:
    """``pieces`` (chunk index, offset, bytes) regrouped into ``parts`` runs of about
    ``total / parts`` bytes each, cutting pieces where a run ends."""
    share = -(-total // parts)
    groups: list[list[tuple[int, int, int]]] = [[]]
    room = share
    for i, off, n in pieces:
        while n > 0:
            if room == 0:
                groups.append([])
                room = share
            take = min(n, room)
            groups[-1].append((i, off, take))
            off, n, room = off + take, n - take, room - take
    return groups


def runs(kept: Sequence[str | None], nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The byte ranges (start, end) covered by consecutive chunks without a digest: what
    staging still has to copy, in as few copies as possible."""
    out: list[tuple[int, int]] = []
    for i, d in enumerate(kept):
        if d is None:
            start, end = i * chunk_bytes, min((i + 1) * chunk_bytes, nbytes)
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], end)
            else:
                out.append((start, end))
    return out
