"""Reading a box of a global tensor from its stored pieces: a resharded restore.

A tensor is stored as one piece (a plain descriptor: the whole tensor) or as shards
(``{"shards": [{"offsets", "shape", "nbytes", "chunks" | "inline"}, ...]}``, see
:mod:`ciuic.shards`). :func:`read_box` returns any box of it (a rank's new shard, or the whole
tensor), reading only the chunks that hold bytes of the box: for each stored piece that meets
the box, the byte range from the first to the last element of the intersection (in the piece's
C order), rounded out to whole chunks, each verified against its name.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ciuic.chain.packreads import PackRuns
from ciuic.chain.repo import Repository
from ciuic.errors import IntegrityError
from ciuic.format.boxes import overlap
from ciuic.format.descriptor import ChunkRef, Shard, TensorDescriptor
from ciuic.restore.leaves import bytes_view, inline_bytes, leaf_layout, uninitialized
from ciuic.restore.sources import Resident, read_from


def pieces_of(desc: TensorDescriptor) -> tuple[Shard, ...]:
    """The stored pieces of a tensor: its shards, or the whole tensor as one."""
    if desc.shards is not None:
        return desc.shards
    return (Shard(offsets=(0,) * len(desc.shape), shape=desc.shape, nbytes=desc.nbytes,
                  inline=desc.inline, chunks=desc.chunks),)


def _flat(index: list[int], shape: list[int]) -> int:
    f = 0
    for i, n in zip(index, shape, strict=True):
        f = f * n + i
    return f


def _strides(shape: list[int]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


class _Piece:
    """The part of one stored piece a box needs: a buffer holding the chunks that cover it."""

    def __init__(self, base: int, buf: torch.Tensor, shape: list[int], ov_off: list[int],
                 ov_shape: list[int], local: list[int]) -> None:
        self.base, self.buf, self.shape = base, buf, shape
        self.ov_off, self.ov_shape, self.local = ov_off, ov_shape, local


def read_box(repo: Repository, path: str, desc: TensorDescriptor, box_off: list[int] | None,
             box_shape: list[int] | None, pool: ThreadPoolExecutor,
             resident: Resident | None = None, runs: PackRuns | None = None) -> torch.Tensor:
    """The box (``box_off``, ``box_shape``; None: the whole tensor) of a stored tensor, as a new
    tensor of that shape, every byte read verified (each chunk from ``resident`` memory where it
    holds it, else from the store; pieces in packs from their runs of ``runs``)."""
    dtype, shape = leaf_layout(path, "tensor", desc)
    item = dtype.itemsize
    box_off = [0] * len(shape) if box_off is None else box_off
    box_shape = shape if box_shape is None else box_shape
    if len(box_off) != len(shape) or len(box_shape) != len(shape):
        raise IntegrityError(f"{path}: a box of rank {len(box_shape)} asked of a tensor of rank "
                             f"{len(shape)}")
    parts: list[_Piece] = []
    futures: list[Future[None]] = []
    covered = 0
    try:
        for piece in pieces_of(desc):
            part = _plan_piece(repo, path, piece, item, box_off, box_shape, pool, futures,
                               resident, runs)
            if part is not None:
                parts.append(part)
                covered += math.prod(part.ov_shape)
        for fut in futures:
            fut.result()
    finally:
        for fut in futures:
            fut.cancel()
    if covered != math.prod(box_shape):
        raise IntegrityError(f"{path}: the stored shards cover {covered} of the "
                             f"{math.prod(box_shape)} elements asked for")
    if len(parts) == 1 and parts[0].shape == box_shape and parts[0].base == 0:
        # the box is exactly one stored piece (a restore on the same world size): its buffer
        # already holds the box in C order
        return parts[0].buf[:math.prod(box_shape) * item].view(dtype).reshape(box_shape)
    out = torch.empty(box_shape, dtype=dtype)
    for part in parts:
        first = _flat(part.local, part.shape) * item - part.base
        typed = part.buf.view(dtype)
        src = typed.as_strided(part.ov_shape, _strides(part.shape), first // item)
        dst = out[tuple(slice(o - b, o - b + n) for o, b, n in
                        zip(part.ov_off, box_off, part.ov_shape, strict=True))]
        dst.copy_(src)
    return out


def box_refs(path: str, desc: TensorDescriptor, box_off: list[int] | None,
             box_shape: list[int] | None) -> list[ChunkRef]:
    """The chunks :func:`read_box` reads for this box (what a restore registers with its
    :class:`PackRuns` before reading)."""
    dtype, shape = leaf_layout(path, "tensor", desc)
    item = dtype.itemsize
    box_off = [0] * len(shape) if box_off is None else box_off
    box_shape = shape if box_shape is None else box_shape
    out: list[ChunkRef] = []
    for piece in pieces_of(desc):
        span = _span(path, piece, item, box_off, box_shape)
        if span is not None and piece.inline is None:
            out.extend(ref for ref, _ in _needed(piece, *span[2]))
    return out


def _span(path: str, piece: Shard, item: int, box_off: list[int], box_shape: list[int]
          ) -> tuple[tuple[list[int], list[int]], list[int], tuple[int, int]] | None:
    """Where a stored piece meets the box: (the overlap's offsets and shape, the overlap's
    start in the piece, the piece's byte range from its first to its last element); None
    where they do not meet."""
    off, pshape, nbytes = list(piece.offsets), list(piece.shape), piece.nbytes
    if (math.prod(pshape) * item != nbytes or len(off) != len(box_off)
            or len(pshape) != len(box_off)):
        raise IntegrityError(f"{path}: shard at {off} of shape {pshape} does not hold "
                             f"{nbytes} bytes")
    ov = overlap(off, pshape, box_off, box_shape)
    if ov is None:
        return None
    local = [o - p for o, p in zip(ov[0], off, strict=True)]
    lo = _flat(local, pshape) * item
    hi = (_flat([x + n - 1 for x, n in zip(local, ov[1], strict=True)], pshape) + 1) * item
    return ov, local, (lo, hi)


def _needed(piece: Shard, lo: int, hi: int) -> list[tuple[ChunkRef, int]]:
    """The chunks of a piece that hold bytes of ``[lo, hi)``, each with where it starts."""
    needed, pos = [], 0
    for ref in piece.chunks or ():
        if pos < hi and pos + ref.nbytes > lo:
            needed.append((ref, pos))
        pos += ref.nbytes
    return needed


def _plan_piece(repo: Repository, path: str, piece: Shard, item: int,
                box_off: list[int], box_shape: list[int], pool: ThreadPoolExecutor,
                futures: list[Future[None]], resident: Resident | None,
                runs: PackRuns | None) -> _Piece | None:
    span = _span(path, piece, item, box_off, box_shape)
    if span is None:
        return None
    (ov_off, ov_shape), local, (lo, hi) = span
    pshape = list(piece.shape)
    if piece.inline is not None:
        return _Piece(0, inline_bytes(path, piece.inline, piece.nbytes), pshape, ov_off,
                      ov_shape, local)
    needed = _needed(piece, lo, hi)
    start, end = needed[0][1], needed[-1][1] + needed[-1][0].nbytes
    base = start - start % item  # the buffer starts on an element boundary
    size = -(-(end - base) // item) * item
    buf = uninitialized(size)
    view = bytes_view(buf)
    for ref, at in needed:
        futures.append(pool.submit(read_from, repo, resident, ref,
                                   view[at - base:at - base + ref.nbytes], runs))
    return _Piece(base, buf, pshape, ov_off, ov_shape, local)
