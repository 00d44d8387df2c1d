"""Writing one snapshot: leaves -> chunks -> body -> manifest (commit) -> catalog row.

The write order is the format's core invariant (docs/format.md, "Write order"):

1. every chunk the store lacks, each durable before the next step;
2. the body (content-addressed);
3. the manifest, with an atomic create-if-absent: **the commit point**;
4. the catalog row (an index; a crash before it is healed by ``Repository.sync_job``).

A crash anywhere before 3 leaves the previous snapshot the latest and this one invisible.
"""

from __future__ import annotations

import base64
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ciuic import knobs
from ciuic.chain.gc import InflightSave
from ciuic.chain.lease import Lease
from ciuic.chain.lease import check as check_lease
from ciuic.chain.repo import Repository
from ciuic.engine.compression import CompressionPolicy, float_kind
from ciuic.errors import StoreError
from ciuic.faults import failpoint
from ciuic.format import chunks as ck
from ciuic.format import layout
from ciuic.format import manifest as mf
from ciuic.format.crypto import ObjectCodec
from ciuic.format.layout import commit_lock_name
from ciuic.format.tree import Leaf, dtype_name
from ciuic.state.capture import Captured


@dataclass
class ChunkCache:
    """Chunk digests known to be in the store, valid for one gc epoch."""

    epoch: int = -2
    digests: set[str] = field(default_factory=set)
    #: chunks a restore found damaged in the store: written again, over the damaged copy, by
    #: the next snapshot that holds their bytes (not skipped as already stored)
    suspect: set[str] = field(default_factory=set)

    def sync(self, epoch: int) -> None:
        if epoch != self.epoch or epoch < 0:
            self.digests.clear()
            self.epoch = epoch


def leaf_bytes(leaf: Leaf) -> memoryview:
    """The raw little-endian bytes of a leaf, without copying when already contiguous on CPU."""
    v = leaf.value
    if isinstance(v, torch.Tensor):
        t = v.detach().resolve_conj().resolve_neg()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous().reshape(-1)
        if t.numel() == 0:
            return memoryview(b"")
        return memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]
    a = np.ascontiguousarray(v)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return memoryview(a.reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def _describe(leaf: Leaf) -> dict[str, Any]:
    v = leaf.value
    if isinstance(v, torch.Tensor):
        return {"dtype": dtype_name(v.dtype), "shape": list(v.shape)}
    dt = v.dtype.newbyteorder("<") if v.dtype.byteorder == ">" else v.dtype
    return {"dtype": dt.str, "shape": list(v.shape)}


class _ChunkWriter:
    """Hashes pieces and writes those the store lacks, on a few threads (BLAKE3 and the
    store's writes release the GIL). Identical pieces within a snapshot are written once."""

    def __init__(self, repo: Repository, cache: ChunkCache, codec: ObjectCodec,
                 compression: CompressionPolicy) -> None:
        self.store = repo.store
        self.cache = cache
        self.codec = codec
        self.compression = compression
        self.lock = threading.Lock()
        self.stored_bytes = 0  # what the new chunks take in the store (after compression)

        #: digest of each piece, when hashed ahead (batch mode), and the chunks the store lacks
        self.named: dict[int, str] = {}
        self.lacking: set[str] | None = None

    def ask_in_one_batch(self, pieces: list[memoryview], known: list[str | None],
                         pool: ThreadPoolExecutor) -> None:
        """Hash every piece now and ask the store once which chunks it lacks (a server: one
        round trip per snapshot instead of one per chunk)."""
        digests = list(pool.map(lambda p, d: d or self.codec.name(p), pieces, known))
        self.named = {id(p): d for p, d in zip(pieces, digests, strict=True)}
        with self.lock:
            candidates = sorted({layout.chunk_key(d) for d in digests
                                 if d not in self.cache.digests})
        self.lacking = set(self.store.missing(candidates))

    def __call__(self, piece: memoryview, kind: tuple[str, int] | None,
                 known: str | None) -> tuple[str, int]:
        """Name ``piece`` (``known``: its digest, from the last snapshot of the same bytes) and
        write it unless the store has it. Returns (digest, bytes written)."""
        d = known or self.named.get(id(piece)) or self.codec.name(piece)
        with self.lock:
            if d in self.cache.digests:
                return d, 0
            self.cache.digests.add(d)  # claimed: a twin piece in this snapshot skips the write
            replace = d in self.cache.suspect
        try:
            key = layout.chunk_key(d)
            present = not replace and (key not in self.lacking if self.lacking is not None
                                       else self.store.has(key))
            if present:
                return d, 0
            encoded = self.compression.encode(kind, piece)
            failpoint("chunk.put")
            self.store.put(key, self.codec.chunk(key, piece, encoded), durable=False)  # synced
            with self.lock:
                self.stored_bytes += len(piece) if encoded is None else len(encoded)
                self.cache.suspect.discard(d)
            return d, len(piece)
        except BaseException:
            with self.lock:
                self.cache.digests.discard(d)
            raise


def write_leaves(repo: Repository, leaves: list[Leaf], cache: ChunkCache,
                 codec: ObjectCodec, compression: CompressionPolicy | None = None
                 ) -> tuple[int, int, int]:
    """Store every leaf's chunks the store lacks; fill descriptors. Returns the bytes of the
    state, of its new chunks, and what those new chunks take in the store (compressed).

    A leaf's chunks whose digests staging found unchanged (``Leaf.digests``) are not hashed
    again."""
    k = knobs.get()
    total = new = 0
    compression = compression or CompressionPolicy("off")
    compression.start_snapshot()
    pieces: list[memoryview] = []
    kinds: list[tuple[str, int] | None] = []
    known: list[str | None] = []  # each piece's digest where staging found it unchanged
    owners: list[dict[str, Any]] = []
    chunked: list[tuple[Leaf, dict[str, Any]]] = []
    for leaf in leaves:
        data = leaf_bytes(leaf)
        desc = _describe(leaf)
        desc["nbytes"] = len(data)
        total += len(data)
        if len(data) <= k.inline_max_bytes:
            desc["inline"] = base64.b64encode(data).decode("ascii")
        else:
            desc["chunks"] = []
            chunked.append((leaf, desc))
            kind = float_kind(leaf.value)
            split = ck.split(len(data), k.chunk_bytes)
            hints = (leaf.digests[1] if leaf.digests is not None
                     and leaf.digests[0] == k.chunk_bytes and len(leaf.digests[1]) == len(split)
                     else [None] * len(split))
            for (off, n), hint in zip(split, hints, strict=True):
                pieces.append(data[off:off + n])
                kinds.append(kind)
                known.append(hint)
                owners.append(desc)
        leaf.descriptor.clear()
        leaf.descriptor.update(desc)
        leaf.digests = None  # set again below, once every chunk is named
    writer = _ChunkWriter(repo, cache, codec, compression)
    # new threads inherit the caller's priority: lowered under an asynchronous snapshot's
    # writer, normal under a synchronous one (engine/background.py)
    with ThreadPoolExecutor(k.write_threads, thread_name_prefix="ciuic-chunk") as pool:
        if repo.store.batch_missing and pieces:
            writer.ask_in_one_batch(pieces, known, pool)
        for desc, piece, (d, wrote) in zip(
                owners, pieces, pool.map(writer, pieces, kinds, known), strict=True):
            desc["chunks"].append([d, len(piece)])
            new += wrote
    for leaf, desc in chunked:
        leaf.digests = (k.chunk_bytes, [d for d, _ in desc["chunks"]])
    return total, new, writer.stored_bytes


def write_snapshot(repo: Repository, project: str, job: str, step: int, parent: str,
                   captured: Captured, cache: ChunkCache, world_size: int = 1,
                   lease: Lease | None = None, codec: ObjectCodec | None = None,
                   compression: CompressionPolicy | None = None) -> tuple[mf.Manifest, str]:
    """Persist ``captured`` as a snapshot of ``project/job`` and commit it.

    Returns (manifest, snapshot ID).
    """
    store = repo.store
    with InflightSave(store) as inflight:
        cache.sync(inflight.epoch)
        codec = codec or ObjectCodec()
        total, new, _stored = write_leaves(repo, captured.leaves, cache, codec, compression)
        failpoint("chunks.sync")
        store.sync()  # every chunk durable before anything refers to it
        return commit_snapshot(repo, project, job, step, parent, captured.states,
                               captured.metrics, len(captured.leaves), total, new,
                               world_size=world_size, lease=lease, codec=codec)


def commit_snapshot(repo: Repository, project: str, job: str, step: int, parent: str,
                    states: dict[str, Any], metrics: dict[str, Any], tensors: int, total: int,
                    new: int, *, world_size: int = 1, lease: Lease | None = None,
                    codec: ObjectCodec | None = None,
                    distributed: bool = False) -> tuple[mf.Manifest, str]:
    """Write the body, then the manifest (the commit point), then the catalog row. Every chunk
    the states reference must already be durable."""
    store = repo.store
    codec = codec or ObjectCodec()
    body = mf.encode_body(states, distributed=distributed)
    body_digest = codec.name(body)
    failpoint("body.put")
    bkey = layout.body_key(project, job, body_digest)
    store.put(bkey, codec.meta(bkey, body))
    m = mf.Manifest(
        project=project, job=job, step=step, parent=parent, created=mf.utc_now(),
        body=body_digest, body_bytes=len(body), total_bytes=total, new_bytes=new,
        tensors=tensors, world_size=world_size, metrics=metrics,
    )
    data = m.encode()
    sid = codec.name(data)
    # commit only after every chunk and the body are durable
    failpoint("manifest.create")
    key = layout.manifest_key(project, job, sid)
    with store.lock(commit_lock_name(project, job)):
        if lease is not None:
            check_lease(store, lease)  # a process that was taken over never commits
        # An existing manifest with our exact bytes (salted body, microsecond time) can
        # only be ours: a create that succeeded but whose reply was lost, then retried.
        if not store.create(key, codec.meta(key, data)) and repo.open_meta(
                key, store.get(key))[0] != data:
            raise StoreError(f"{store.location(key)} exists with other content")
    failpoint("catalog.insert")
    repo.catalog.add_snapshot(m, sid)
    return m, sid
