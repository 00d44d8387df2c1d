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
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from ciuic import knobs
from ciuic.chain.chunkwriter import ChunkCache, ChunkWriter, naming_threads
from ciuic.chain.gc import InflightSave, collect
from ciuic.chain.health import HealthTracker
from ciuic.chain.lease import Lease
from ciuic.chain.lease import check as check_lease
from ciuic.chain.packs import carried
from ciuic.chain.repo import Repository
from ciuic.engine.compression import CompressionPolicy, float_kind
from ciuic.errors import DiskFull, StoreError
from ciuic.faults import failpoint
from ciuic.format import chunks as ck
from ciuic.format import layout
from ciuic.format import manifest as mf
from ciuic.format import stats as st
from ciuic.format.crypto import ObjectCodec
from ciuic.format.descriptor import ChunkRef, TensorDescriptor
from ciuic.format.layout import commit_lock_name
from ciuic.format.tree import Leaf, dtype_name
from ciuic.state.capture import Captured
from ciuic.words import counted

__all__ = ["BATCH_BYTES", "ChunkCache", "SnapshotContent", "SnapshotWrite", "Written",
           "commit_snapshot", "remove_unreferenced", "write_leaves", "write_snapshot"]

log = logging.getLogger("ciuic")


def _flat(leaf: Leaf) -> torch.Tensor | np.ndarray:
    """A leaf's value as a flat, contiguous, little-endian CPU tensor or array."""
    v = leaf.value
    if isinstance(v, torch.Tensor):
        t = v.detach().resolve_conj().resolve_neg()
        if t.device.type != "cpu":
            t = t.to("cpu")
        return t.contiguous().reshape(-1)
    a = np.ascontiguousarray(v)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.reshape(-1)


def _raw(flat: torch.Tensor | np.ndarray) -> memoryview:
    if isinstance(flat, torch.Tensor):
        if flat.numel() == 0:
            return memoryview(b"")
        return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
    return memoryview(flat.view(np.uint8))  # type: ignore[arg-type]


#: Pieces under this size are named and written in batches of up to this many bytes: one
#: store call asks about a batch's chunks and one writes those the store lacks, where one per
#: chunk cost a small model's snapshot (the demo's: 89 chunks of 57 KiB on average) most of
#: its CPU time in thread hand-offs.
BATCH_BYTES = 1 << 20


def _batches(sizes: list[int]) -> list[list[int]]:
    """The indexes of consecutive pieces, grouped: each large piece alone, small ones together
    up to :data:`BATCH_BYTES`."""
    batches: list[list[int]] = []
    held = BATCH_BYTES  # bytes in the last batch: full, until a small piece opens one
    for i, n in enumerate(sizes):
        if n >= BATCH_BYTES or held + n > BATCH_BYTES:
            batches.append([i])
            held = n
        else:
            batches[-1].append(i)
            held += n
    return batches


def _itemsize(flat: torch.Tensor | np.ndarray) -> int:
    return flat.element_size() if isinstance(flat, torch.Tensor) else int(flat.itemsize)


class _Described:
    """One chunked leaf being written: its bytes, cut into pieces, and what its descriptor
    gathers as the pieces are named (their chunk references and, for a float leaf, their
    statistics)."""

    def __init__(self, leaf: Leaf, flat: torch.Tensor | np.ndarray, data: memoryview,
                 floats: bool, chunk_bytes: int) -> None:
        self.leaf = leaf
        self.flat = flat
        self.data = data
        size = _itemsize(flat)
        #: a float leaf's statistics reduced piece by piece (a piece holds whole elements),
        #: else over the whole leaf once its pieces are queued
        self.by_piece = floats and chunk_bytes % size == 0
        self.whole = floats and not self.by_piece
        self.refs: list[ChunkRef] = []
        self.stats: list[st.Stats | None] = []
        self.whole_stats: st.Stats | None = None
        split = ck.split(len(data), chunk_bytes)
        hints = (leaf.digests[1] if leaf.digests is not None and leaf.digests[0] == chunk_bytes
                 and len(leaf.digests[1]) == len(split) else [None] * len(split))
        kind = float_kind(leaf.value)
        self.pieces = [_Piece(data[off:off + n], kind, hint, self,
                              flat[off // size:(off + n) // size] if self.by_piece else None)
                       for (off, n), hint in zip(split, hints, strict=True)]

    def named(self, ref: ChunkRef, stats: st.Stats | None) -> None:
        """A piece was named (in order): its chunk and its statistics."""
        self.refs.append(ref)
        self.stats.append(stats)

    def descriptor(self) -> TensorDescriptor:
        """The leaf's descriptor, once every piece is named."""
        stats = st.combine(self.stats) if self.by_piece else self.whole_stats
        return TensorDescriptor(**_layout(self.leaf), nbytes=len(self.data),
                                chunks=tuple(self.refs),
                                stats=None if stats is None else stats.to_json())


@dataclass(frozen=True)
class _Piece:
    """One chunk's worth of a leaf's bytes: the unit the writer names and writes."""

    data: memoryview
    #: the float codec's kind (format/chunks: compressible floats), or None
    kind: tuple[str, int] | None
    #: its digest, where staging found these bytes unchanged since the last snapshot
    known: str | None
    owner: _Described
    #: its elements, when the owner's statistics are reduced piece by piece
    span: torch.Tensor | np.ndarray | None
    #: written again into a pack of carried pieces, its old pack mostly dead (chain/packs.py)
    carry: bool = False


class _Namer:
    """Names a batch of pieces (and queues the writes of those the store lacks) on a naming
    thread, and reduces each float piece's statistics, unless the last snapshot already
    reduced the same bytes (same digest, same dtype)."""

    def __init__(self, writer: ChunkWriter, seen: dict[tuple[str, str], st.Stats]) -> None:
        self.writer = writer
        self.seen = seen
        self.reduced: dict[tuple[str, str], st.Stats] = {}  # this snapshot's, for the next

    def reuse(self, piece: _Piece) -> tuple[ChunkRef, int, st.Stats | None] | None:
        """A piece staging found unchanged, whose chunk is known to be stored and whose
        statistics the last snapshot reduced: named at once, on the calling thread, or None
        where it needs a naming thread. Handing every piece to the naming threads in order put
        an incremental snapshot's first write behind all the unchanged pieces before it."""
        d = piece.known
        if d is None:
            return None
        with self.writer.lock:  # (a suspect chunk is not in digests: distrust() drops it)
            ref = self.writer.cache.packed.get(d) if self.writer.packed(piece.data) else None
            if ref is None or ref.nbytes != len(piece.data):
                if d not in self.writer.cache.digests:
                    return None
                ref = ChunkRef(d, len(piece.data))
        if piece.span is None:
            return ref, 0, None
        stats = self._recall((d, str(piece.span.dtype)))
        return None if stats is None else (ref, 0, stats)

    def _recall(self, key: tuple[str, str]) -> st.Stats | None:
        """The statistics reduced before for ``key`` (digest, dtype), kept for the next
        snapshot; None if never reduced."""
        got = self.seen.get(key) or self.reduced.get(key)
        if got is not None:
            self.reduced[key] = got
        return got

    def __call__(self, batch: list[_Piece]) -> list[tuple[ChunkRef, int, st.Stats | None]]:
        out: list[tuple[ChunkRef, int, st.Stats | None]] = []
        named = self.writer([(p.data, p.kind, p.known, p.carry) for p in batch])
        for piece, (ref, wrote) in zip(batch, named, strict=True):
            if piece.span is None:
                out.append((ref, wrote, None))
                continue
            key = (ref.digest, str(piece.span.dtype))
            got = self._recall(key)
            if got is None:
                got = self.reduced[key] = st.compute(piece.span)
            out.append((ref, wrote, got))
        return out


def _layout(leaf: Leaf) -> dict[str, Any]:
    """A leaf's dtype (the format's name, little-endian) and shape."""
    v = leaf.value
    if isinstance(v, torch.Tensor):
        return {"dtype": dtype_name(v.dtype), "shape": tuple(v.shape)}
    dt = v.dtype.newbyteorder("<") if v.dtype.byteorder == ">" else v.dtype
    return {"dtype": dt.str, "shape": tuple(v.shape)}


class Written(NamedTuple):
    """What :func:`write_leaves` wrote: the state's bytes, those of its new chunks, and what
    the new chunks take in the store (compressed)."""

    total: int
    new: int
    stored: int


def write_leaves(repo: Repository, leaves: list[Leaf], cache: ChunkCache,
                 codec: ObjectCodec, compression: CompressionPolicy | None = None,
                 stats: bool = True, created: set[str] | None = None) -> Written:
    """Store every leaf's chunks the store lacks and set each leaf's descriptor.

    A small leaf is inlined; a larger one is cut into pieces (:class:`_Piece`) that are named
    and written in batches on the naming threads. A leaf's chunks whose digests staging found
    unchanged (``Leaf.digests``) are not hashed again. With ``stats``, every float leaf's
    descriptor gets its statistics (:mod:`ciuic.format.stats`), reduced piece by piece on the
    threads that hash the pieces; a piece the last snapshot already reduced (same digest, same
    dtype) is not reduced again. ``created`` gathers the keys of the chunks written that the
    store lacked."""
    k = knobs.get()
    compression = compression or CompressionPolicy("off")
    compression.start_snapshot()
    cache.confirm(repo.store)  # the pieces a restore read from packs, if still stored
    total = new = 0
    chunked: list[_Described] = []
    for leaf in leaves:
        flat = _flat(leaf)
        data = _raw(flat)
        total += len(data)
        floats = stats and st.is_float(flat)
        if len(data) <= k.inline_max_bytes:
            leaf.describe(TensorDescriptor(
                **_layout(leaf), nbytes=len(data),
                inline=base64.b64encode(data).decode("ascii"),
                stats=st.compute(flat).to_json() if floats else None))
        else:
            chunked.append(_Described(leaf, flat, data, floats, k.chunk_bytes))
        leaf.digests = None  # set again below, once every chunk is named (read above)
    pieces = [p for d in chunked for p in d.pieces]
    # new threads inherit the caller's priority: lowered under an asynchronous snapshot's
    # writer, normal under a synchronous one (manager/pipeline.py)
    with ThreadPoolExecutor(k.write_threads, thread_name_prefix="ciuic-write") as io, \
            ThreadPoolExecutor(naming_threads(), thread_name_prefix="ciuic-chunk") as pool:
        writer = ChunkWriter(repo, cache, codec, compression, io, k.write_threads,
                              created if created is not None else set(), k.pack_bytes)
        if repo.store.batch_missing and pieces:
            writer.ask_in_one_batch([p.data for p in pieces], [p.known for p in pieces], pool)
        namer = _Namer(writer, cache.stats)
        reused = [namer.reuse(p) for p in pieces]
        # pieces in packs this snapshot would hardly use: written again (chain/packs.py)
        for i in carried([None if got is None else got[0] for got in reused], cache.pack_bytes):
            reused[i] = None
            pieces[i] = dataclasses.replace(pieces[i], carry=True)
        rest = [p for p, got in zip(pieces, reused, strict=True) if got is None]
        batches = [[rest[i] for i in b] for b in _batches([len(p.data) for p in rest])]
        named = (out for batch, outs in zip(batches, pool.map(namer, batches), strict=True)
                 for out in zip(batch, outs, strict=True))
        # in order: each leaf's chunk references are its pieces' in turn
        for piece, got in zip(pieces, reused, strict=True):
            if got is None:
                done, got = next(named)
                assert done is piece
            ref, wrote, piece_stats = got
            piece.owner.named(ref, piece_stats)
            new += wrote
        for d in chunked:  # while the last writes run
            if d.whole:
                d.whole_stats = st.compute(d.flat)
        writer.drain()  # (on an error above, leaving the pools waits for the queued writes)
    cache.stats = namer.reduced
    for d in chunked:
        d.leaf.describe(d.descriptor())
        d.leaf.digests = (k.chunk_bytes, [r.digest for r in d.refs])
    return Written(total, new, writer.stored_bytes)


@dataclass(frozen=True)
class SnapshotWrite:
    """Where one snapshot goes and how it is written: what the writer and the commit need
    besides the state. Each pipeline (manager/pipeline.py, manager/ranked.py) builds one per
    snapshot; ``ciuic_client`` builds its own."""

    repo: Repository
    project: str
    job: str
    step: int
    #: the snapshot this one links to; "" for the first of a lineage
    parent: str
    cache: ChunkCache
    codec: ObjectCodec = field(default_factory=ObjectCodec)
    compression: CompressionPolicy | None = None
    #: with a tracker, the tensors' statistics are computed and the snapshot's health judged
    health: HealthTracker | None = None
    #: the job's lease: a process that was taken over never commits
    lease: Lease | None = None


@dataclass(frozen=True)
class SnapshotContent:
    """What a commit records besides the chunks: the body's state trees (their descriptors
    set), the metrics, and the counts the manifest carries."""

    states: dict[str, Any]
    metrics: dict[str, Any]
    tensors: int
    total_bytes: int
    new_bytes: int
    world_size: int = 1
    #: a multi-rank body (format 2: sharded descriptors, per-rank states)
    distributed: bool = False
    #: the index of a body in parts (format 3: docs/format.md, "Distributed snapshots")
    split: bool = False
    #: statistics the health verdict judges beside the states' (a split body's per-rank
    #: tensors, which its parts hold), by path
    stats: dict[str, st.Stats] = field(default_factory=dict)


def write_snapshot(w: SnapshotWrite, captured: Captured) -> tuple[mf.Manifest, str]:
    """Persist ``captured`` as a snapshot and commit it. Returns (manifest, snapshot ID).

    On a full disk, a snapshot that fails removes the chunks it wrote that nothing references
    (:func:`remove_unreferenced`): else every failed snapshot left a full disk fuller."""
    created: set[str] = set()
    try:
        with InflightSave(w.repo.store) as inflight:
            w.cache.sync(inflight.epoch)
            written = write_leaves(w.repo, captured.leaves, w.cache, w.codec, w.compression,
                                   stats=w.health is not None, created=created)
            failpoint("chunks.sync")  # made durable with the body, before the manifest
            return commit_snapshot(w, SnapshotContent(
                captured.states, captured.metrics, len(captured.leaves), written.total,
                written.new))
    except DiskFull:
        remove_unreferenced(w.repo, created, w.cache)
        raise


def remove_unreferenced(repo: Repository, created: set[str], cache: ChunkCache) -> None:
    """Remove the chunks of ``created`` (a failed snapshot's: chunks the store lacked) that no
    snapshot references, under gc's protocol: only while no other save is in flight (it may
    have found them stored and use them), and keeping those a snapshot committed since uses.
    Where it cannot, ``ciuic gc`` removes them later."""
    if not created:
        return
    cache.digests.difference_update(d for d in map(layout.chunk_digest, created) if d)
    gone = {layout.pack_name(k) for k in created} - {None}
    for d in [d for d, ref in cache.packed.items() if ref.pack in gone]:
        del cache.packed[d]
    try:
        result = collect(repo, only=created)
    except Exception as e:
        log.warning("the failed snapshot's chunks stay in the store (%s); `ciuic gc` removes "
                    "them", e)
        return
    if result.skipped:
        log.warning("the failed snapshot's chunks stay in the store (%s); `ciuic gc` removes "
                    "them", result.skipped)
    elif result.deleted_chunks:
        log.warning("removed the failed snapshot's %s (%d bytes) from the full store",
                    counted(result.deleted_chunks, "chunk object" if not any(
                        layout.pack_name(k) for k in created) else "object"),
                    result.deleted_bytes)


def commit_snapshot(w: SnapshotWrite, content: SnapshotContent) -> tuple[mf.Manifest, str]:
    """Write the body, then the manifest (the commit point), then the catalog row. Every chunk
    the states reference must already be written: the store's ``sync()`` makes those written
    without ``durable`` and the body durable together (one batch of parallel fsyncs, not the
    body's two after the chunks'), before the manifest names them. With ``w.health``, the
    manifest records the snapshot's health, judged against the recent chain."""
    repo, store, codec, health = w.repo, w.repo.store, w.codec, w.health
    verdict = None
    if health is not None:
        try:
            verdict = health.judge(repo, w.project, w.job, w.parent, content.states,
                                   content.metrics, content.stats)
        except Exception:  # advisory: a defect in judging never loses the snapshot
            log.exception("snapshot health could not be judged; the snapshot is written "
                          "without a verdict (please report this)")
    body = mf.encode_body(content.states, distributed=content.distributed,
                          split=content.split)
    body_digest = codec.name(body)
    failpoint("body.put")
    bkey = layout.body_key(w.project, w.job, body_digest)
    store.put(bkey, codec.meta(bkey, body), durable=False)
    store.sync()  # the chunks and the body durable before anything refers to them
    m = mf.Manifest(
        project=w.project, job=w.job, step=w.step, parent=w.parent, created=mf.utc_now(),
        body=body_digest, body_bytes=len(body), total_bytes=content.total_bytes,
        new_bytes=content.new_bytes, tensors=content.tensors, world_size=content.world_size,
        metrics=content.metrics, health=verdict,
    )
    data = m.encode()
    sid = codec.name(data)
    # commit only after every chunk and the body are durable
    failpoint("manifest.create")
    key = layout.manifest_key(w.project, w.job, sid)
    with store.lock(commit_lock_name(w.project, w.job)):
        if w.lease is not None:
            check_lease(store, w.lease)  # a process that was taken over never commits
        # An existing manifest with our exact bytes (salted body, microsecond time) can
        # only be ours: a create that succeeded but whose reply was lost, then retried.
        if not store.create(key, codec.meta(key, data)) and repo.open_meta(
                key, store.get(key))[0] != data:
            raise StoreError(f"{store.location(key)} exists with other content")
    if health is not None and verdict is not None:
        health.committed(sid, content.metrics, verdict.healthy)
        health.warn(w.project, w.job, w.step)
    failpoint("catalog.insert")
    repo.catalog.add_snapshot(m, sid)
    return m, sid
