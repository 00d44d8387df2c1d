"""Reading snapshots back: manifest -> body -> verified chunks -> tensors. Never unpickles.

Every byte is checked before use: the manifest against its ID, the body against the manifest,
each chunk against its name and length. Damage raises :class:`~ciuic.errors.CorruptObject`
naming the object; a missing object raises it too (as "missing").
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from . import chunks as ck
from . import manifest as mf
from .digest import digest
from .errors import CorruptObject, IntegrityError, ObjectNotFound
from .info import SnapshotInfo
from .repo import Repository
from .store import Store
from .tree import decode, torch_dtype, walk_leaves

_POOL_WORKERS = max(4, min(16, 2 * (os.cpu_count() or 2)))


def read_body(repo: Repository, info: SnapshotInfo) -> tuple[mf.Manifest, dict[str, Any]]:
    """The verified manifest and body trees of a snapshot."""
    m = repo.read_manifest(info.project, info.job, info.id)
    return m, body_states(repo, m)


def body_states(repo: Repository, m: mf.Manifest) -> dict[str, Any]:
    """The verified states of a manifest's body. ObjectNotFound when it was pruned."""
    key = mf.body_key(m.project, m.job, m.body)

    def read(store: Store) -> dict[str, Any]:
        try:
            blob = store.get(key)
        except ObjectNotFound:
            raise CorruptObject(key, "missing (the snapshot was pruned or its body was lost)"
                                ) from None
        data, name_key = repo.open_meta(key, blob)
        if len(data) != m.body_bytes:
            raise CorruptObject(key, f"size {len(data)} differs from the manifest's "
                                f"{m.body_bytes}")
        return mf.decode_body(data, key, m.body, name_key)

    return repo.read_verified(key, read)


def _read_chunk(repo: Repository, d: str, n: int, dest: memoryview) -> None:
    """Read chunk ``d`` (plaintext length ``n``) straight into ``dest`` and verify it."""
    key = ck.chunk_key(d)

    def read(store: Store) -> None:
        header = bytearray(ck.HEADER_BYTES)
        try:
            size = store.get_into(key, [memoryview(header), dest])
            if ck.is_sealed(header):
                check_chunk_blob(repo, key, store.get(key), d, n, dest)
                return
        except ObjectNotFound:
            raise CorruptObject(key, "missing") from None
        ck.check_read(key, header, size, dest, d, n)

    repo.read_verified(key, read)


def check_chunk_blob(repo: Repository, key: str, blob: bytes, d: str, n: int | None,
                     dest: memoryview | None = None) -> None:
    """Check a whole stored chunk (plain or sealed) against its name; optionally copy its
    plaintext into ``dest``. ``n``: the expected length (None: the header's)."""
    if not ck.is_sealed(blob[:ck.HEADER_BYTES]):
        n = ck.header_length(blob[:ck.HEADER_BYTES]) if n is None else n
        plain = ck.unframe(key, blob, d, n)
    else:
        opened, used = repo.keyring.open(key, blob)
        if n is not None and len(opened) != n:
            raise CorruptObject(key, f"length {len(opened)} differs from the expected {n}")
        if digest(opened, key=used.name_key) != d:
            raise CorruptObject(key, "content hash does not match its name")
        plain = memoryview(opened)
    if dest is not None:
        dest[:] = plain


def _get_chunk(repo: Repository, d: str, n: int) -> None:
    _read_chunk(repo, d, n, memoryview(bytearray(n)))


def _uninitialized(nbytes: int) -> torch.Tensor:
    """A flat byte tensor whose memory is not zero-filled first: every byte is about to be
    overwritten by a read, and zero-filling a large buffer costs as much as reading it."""
    return torch.empty(nbytes, dtype=torch.uint8)


def _bytes_view(flat: torch.Tensor) -> memoryview:
    return flat.numpy().data.cast("B") if flat.numel() else memoryview(b"")


def inline_bytes(path: str, desc: dict[str, Any], nbytes: int) -> torch.Tensor:
    """The bytes of an inline descriptor (or shard), checked against ``nbytes``."""
    raw = base64.b64decode(desc["inline"])
    if len(raw) != nbytes:
        raise IntegrityError(f"{path}: inline data has {len(raw)} bytes, expected {nbytes}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else _uninitialized(0)


def chunk_list(path: str, desc: dict[str, Any], nbytes: int) -> list[tuple[str, int]]:
    """The ``[digest, length]`` list of a descriptor (or shard), checked to add up."""
    try:
        refs = [(str(d), int(n)) for d, n in desc["chunks"]]
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"{path}: malformed chunk list: {e}") from e
    if sum(n for _, n in refs) != nbytes:
        raise IntegrityError(f"{path}: chunk sizes do not add up to {nbytes} bytes")
    return refs


BufferFor = Callable[[str, int], "torch.Tensor | None"]


def _leaf_buffer(repo: Repository, path: str, kind: str, desc: dict[str, Any],
                 pool: ThreadPoolExecutor, buffer_for: BufferFor | None
                 ) -> tuple[torch.Tensor, list[Future[None]]]:
    """A buffer for one leaf (lent by ``buffer_for``, else fresh) and the reads, already
    submitted, that fill and verify it."""
    _leaf_layout(path, kind, desc)
    nbytes = int(desc["nbytes"])
    if "inline" in desc:
        return inline_bytes(path, desc, nbytes), []
    refs = chunk_list(path, desc, nbytes)
    lent = buffer_for(path, nbytes) if buffer_for is not None else None
    out = lent if lent is not None and lent.numel() == nbytes else _uninitialized(nbytes)
    view = _bytes_view(out)
    futures = []
    off = 0
    for d, n in refs:
        futures.append(pool.submit(_read_chunk, repo, d, n, view[off:off + n]))
        off += n
    return out, futures


def _leaf_layout(path: str, kind: str, desc: dict[str, Any]) -> tuple[Any, list[int]]:
    """(dtype, shape) of a leaf, checked against its byte count before anything is read."""
    try:
        shape = [int(x) for x in desc["shape"]]
        nbytes = int(desc["nbytes"])
        if kind == "tensor":
            dtype: Any = torch_dtype(str(desc["dtype"]))
            itemsize = torch.empty((), dtype=dtype).element_size()
        else:
            dtype = np.dtype(str(desc["dtype"]))
            if dtype.hasobject or dtype.names is not None:
                raise IntegrityError(f"{path}: object or structured arrays are never loaded")
            itemsize = dtype.itemsize
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"{path}: malformed tensor descriptor: {e}") from e
    if any(d < 0 for d in shape) or math.prod(shape) * itemsize != nbytes:
        raise IntegrityError(f"{path}: shape {shape} of {desc['dtype']} does not hold "
                             f"{nbytes} bytes")
    return dtype, shape


def _materialize(path: str, kind: str, desc: dict[str, Any], flat: torch.Tensor) -> Any:
    dtype, shape = _leaf_layout(path, kind, desc)
    if kind == "tensor":
        return flat.view(dtype).reshape(shape)
    arr = flat.numpy().view(dtype).reshape(shape) if flat.numel() else np.zeros(shape, dtype)
    return arr[()] if kind == "npscalar" else arr


def load_states(repo: Repository, info: SnapshotInfo, skip: Collection[str] = (),
                buffer_for: BufferFor | None = None) -> tuple[mf.Manifest, dict[str, Any]]:
    """Read and verify a snapshot's states (all but those in ``skip``) as Python values.

    Every read is in flight at once (a thread pool), straight into its tensor's memory, which is
    never zero-filled first. ``buffer_for(path, nbytes)`` may lend a flat uint8 buffer to read a
    leaf into (reused memory); it returns None to let the reader allocate one. Everything is
    read and checked before anything is returned, so a damaged snapshot never reaches live
    objects.
    """
    m, states = read_body(repo, info)
    wanted = {k: v for k, v in states.items() if k not in skip}
    return m, load_trees(repo, wanted, buffer_for)


def load_trees(repo: Repository, wanted: dict[str, Any], buffer_for: BufferFor | None = None
               ) -> dict[str, Any]:
    """Read, verify and decode state trees (name -> tree) into Python values.

    Buffers are kept per descriptor, not per path: snapshots written before ciuic refused
    dict keys of equal text (``{0: a, "0": b}``) hold two leaves under one path, and each
    must come back as itself (the repeated path is not lent a buffer either)."""
    buffers: dict[int, torch.Tensor] = {}  # id(descriptor) -> its bytes
    reads: list[Future[None]] = []
    sharded: list[tuple[str, dict[str, Any]]] = []
    lent: set[str] = set()

    def lend_once(path: str, nbytes: int) -> torch.Tensor | None:
        if buffer_for is None or path in lent:
            return None
        lent.add(path)
        return buffer_for(path, nbytes)

    with ThreadPoolExecutor(_POOL_WORKERS, thread_name_prefix="ciuic-read") as pool:
        try:
            for path, kind, desc in walk_leaves(wanted):  # every read in flight at once
                if "shards" in desc and kind == "tensor":
                    sharded.append((path, desc))  # assembled below, while the rest reads
                    continue
                buffers[id(desc)], submitted = _leaf_buffer(repo, path, kind, desc, pool,
                                                            lend_once)
                reads.extend(submitted)
            if sharded:
                from .boxread import read_box

                for path, desc in sharded:
                    buffers[id(desc)] = read_box(repo, path, desc, None, None, pool).reshape(
                        -1).view(torch.uint8)
            for fut in reads:
                fut.result()
        finally:
            for fut in reads:
                fut.cancel()

    def load_leaf(path: str, kind: str, desc: dict[str, Any]) -> Any:
        return _materialize(path, kind, desc, buffers[id(desc)])

    return {name: decode(tree, name, load_leaf) for name, tree in wanted.items()}


def chunk_refs(states: dict[str, Any]) -> dict[str, int]:
    """digest -> plaintext length of every chunk a body's states reference."""
    refs: dict[str, int] = {}
    for _path, _kind, desc in walk_leaves(states):
        for piece in desc.get("shards", [desc]):
            for d, n in piece.get("chunks", []):
                refs[str(d)] = int(n)
    return refs


def verify_chunks(repo: Repository, refs: dict[str, int], deep: bool,
                  pool: ThreadPoolExecutor) -> list[tuple[str, str]]:
    """Problems (key, reason) with chunks: existence, or (``deep``) a full re-read and re-hash."""

    def check(d: str, n: int) -> tuple[str, str] | None:
        key = ck.chunk_key(d)
        try:
            if deep:
                _get_chunk(repo, d, n)
            elif not repo.store.has(key):
                return key, "missing"
        except CorruptObject as e:
            return e.key, e.reason
        return None

    return [r for r in pool.map(lambda item: check(*item), refs.items()) if r is not None]
