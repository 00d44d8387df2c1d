"""Tensor leaves of a body: their descriptors checked, their buffers allocated (or lent) and
filled by verified chunk reads (from the sources of :mod:`ciuic.restore.sources`), and their
bytes viewed as the tensor or array they hold."""

from __future__ import annotations

import base64
import math
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ciuic.chain.packreads import PackRuns
from ciuic.chain.repo import Repository
from ciuic.errors import IntegrityError
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.tree import torch_dtype
from ciuic.restore.sources import BufferFor, Resident, read_from


def uninitialized(nbytes: int) -> torch.Tensor:
    """A flat byte tensor whose memory is not zero-filled first: every byte is about to be
    overwritten by a read, and zero-filling a large buffer costs as much as reading it."""
    return torch.empty(nbytes, dtype=torch.uint8)


def bytes_view(flat: torch.Tensor) -> memoryview:
    return flat.numpy().data.cast("B") if flat.numel() else memoryview(b"")


def inline_bytes(path: str, inline: str, nbytes: int) -> torch.Tensor:
    """The bytes of an inline descriptor (or shard), checked against ``nbytes``."""
    try:
        raw = base64.b64decode(inline, validate=True)
    except ValueError as e:
        raise IntegrityError(f"{path}: inline data is not base64: {e}") from e
    if len(raw) != nbytes:
        raise IntegrityError(f"{path}: inline data has {len(raw)} bytes, expected {nbytes}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else uninitialized(0)


def leaf_buffer(repo: Repository, path: str, kind: str, desc: TensorDescriptor,
                 pool: ThreadPoolExecutor, buffer_for: BufferFor | None,
                 resident: Resident | None = None, runs: PackRuns | None = None
                 ) -> tuple[torch.Tensor, list[Future[None]]]:
    """A buffer for one leaf (lent by ``buffer_for``, else fresh) and the reads, already
    submitted, that fill and verify it (from ``resident`` memory where it holds the leaf;
    pieces in packs from their runs of ``runs``)."""
    leaf_layout(path, kind, desc)
    nbytes = desc.nbytes
    if desc.inline is not None:
        return inline_bytes(path, desc.inline, nbytes), []
    if desc.chunks is None:
        raise IntegrityError(f"{path}: a sharded tensor where a whole one was expected")
    refs = desc.chunks
    lent = buffer_for(path, nbytes) if buffer_for is not None else None
    out = lent if lent is not None and lent.numel() == nbytes else uninitialized(nbytes)
    view = bytes_view(out)
    src = resident.get(path, nbytes) if resident is not None else None
    src_view = None if src is None or src.data_ptr() == out.data_ptr() else bytes_view(src)
    futures = []
    off = 0
    for ref in refs:
        n = ref.nbytes
        if src is not None and resident is not None:
            futures.append(pool.submit(resident.take, repo, ref, view[off:off + n],
                                       None if src_view is None else src_view[off:off + n]))
        else:
            futures.append(pool.submit(read_from, repo, resident, ref, view[off:off + n],
                                       runs))
        off += n
    return out, futures


def leaf_layout(path: str, kind: str, desc: TensorDescriptor) -> tuple[Any, list[int]]:
    """(dtype, shape) of a leaf, checked against its byte count before anything is read."""
    shape = list(desc.shape)
    try:
        if kind == "tensor":
            dtype: Any = torch_dtype(desc.dtype)
            itemsize = dtype.itemsize
        else:
            dtype = np.dtype(desc.dtype)
            if dtype.hasobject or dtype.names is not None:
                raise IntegrityError(f"{path}: object or structured arrays are never loaded")
            itemsize = dtype.itemsize
    except (TypeError, ValueError) as e:
        raise IntegrityError(f"{path}: malformed tensor descriptor: {e}") from e
    if any(d < 0 for d in shape) or math.prod(shape) * itemsize != desc.nbytes:
        raise IntegrityError(f"{path}: shape {shape} of {desc.dtype} does not hold "
                             f"{desc.nbytes} bytes")
    return dtype, shape


def materialize(path: str, kind: str, desc: TensorDescriptor, flat: torch.Tensor) -> Any:
    dtype, shape = leaf_layout(path, kind, desc)
    if kind == "tensor":
        return flat.view(dtype).reshape(shape)
    arr = flat.numpy().view(dtype).reshape(shape) if flat.numel() else np.zeros(shape, dtype)
    return arr[()] if kind == "npscalar" else arr
