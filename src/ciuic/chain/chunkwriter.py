"""Naming and storing a snapshot's pieces: the chunk cache (what is known to be stored) and the
chunk writer (BLAKE3 names, the store's writes on their own threads, small pieces into packs).
:func:`ciuic.chain.writer.write_leaves` drives it, piece batch by piece batch."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from ciuic import knobs
from ciuic.chain.packs import PackBuilder
from ciuic.chain.repo import Repository
from ciuic.engine.compression import CompressionPolicy, usable_cores
from ciuic.faults import failpoint
from ciuic.format import layout
from ciuic.format import stats as st
from ciuic.format.crypto import ObjectCodec
from ciuic.format.descriptor import ChunkRef
from ciuic.format.digest import Buffer
from ciuic.store import Store


@dataclass
class ChunkCache:
    """Chunk digests known to be in the store, valid for one gc epoch."""

    epoch: int = -2
    digests: set[str] = field(default_factory=set)
    #: chunks a restore found damaged in the store: written again, over the damaged copy, by
    #: the next snapshot that holds their bytes (not skipped as already stored)
    suspect: set[str] = field(default_factory=set)
    #: the statistics of the last snapshot's float pieces, by (digest, dtype): a piece whose
    #: bytes did not change is not reduced again. Replaced by each snapshot's own.
    stats: dict[tuple[str, str], st.Stats] = field(default_factory=dict)
    #: pieces known to be stored inside packs: digest -> where (chain/packs.py)
    packed: dict[str, ChunkRef] = field(default_factory=dict)
    #: the bytes of each pack this process wrote, by name (what the carry rule weighs)
    pack_bytes: dict[str, int] = field(default_factory=dict)
    #: the chunks a restore read, by digest: known stored once :meth:`confirm` has seen their
    #: objects (packs, chunk objects) in the store, inside a save. A piece bound for a pack is
    #: never asked about in the store (that is the point of packs): without these, the first
    #: snapshot after a restart would write every small piece again
    seeds: dict[str, ChunkRef] = field(default_factory=dict)

    def seed(self, refs: dict[str, ChunkRef]) -> None:
        """The chunks of the snapshot a restore read (see :attr:`seeds`)."""
        self.seeds = dict(refs)

    def confirm(self, store: Store) -> None:
        """Inside a save (its in-flight marker holds gc off; after :meth:`sync`): the seeds
        whose objects the store holds are known stored (one question per pack, one batch for
        the chunk objects); the others are forgotten."""
        if not self.seeds:
            return
        seeds, self.seeds = self.seeds, {}
        packs = {ref.pack for ref in seeds.values() if ref.pack is not None}
        present = {p for p in packs if store.has(layout.pack_key(p))}
        plain = sorted(layout.chunk_key(d) for d, ref in seeds.items() if ref.pack is None)
        lacking = set(store.missing(plain)) if plain else set()
        for d, ref in seeds.items():
            if ref.pack is None:
                if layout.chunk_key(d) not in lacking and d not in self.suspect:
                    self.digests.add(d)
            elif ref.pack in present and d not in self.suspect:
                self.packed.setdefault(d, ref)

    def distrust(self, digest: str) -> None:
        """A chunk a restore found damaged: the next snapshot holding its bytes writes it again
        (else every later snapshot would reuse the damaged copy as already stored)."""
        self.suspect.add(digest)
        self.digests.discard(digest)  # "known to be stored" no longer holds
        self.packed.pop(digest, None)  # a packed piece: written again into a new pack

    def sync(self, epoch: int) -> None:
        """A new gc epoch: nothing is known stored any more. The packed pieces become seeds
        (:meth:`confirm` asks once per pack whether it is still there): a piece bound for a
        pack is never asked about itself, and every small piece would be written again."""
        if epoch != self.epoch or epoch < 0:
            self.digests.clear()
            self.seeds = {**self.packed, **self.seeds}
            self.packed.clear()
            self.epoch = epoch



class ChunkWriter:
    """Names pieces and writes those the store lacks. Identical pieces within a snapshot are
    written once.

    Naming (BLAKE3, and the float codec where it compresses) runs on the calling threads; the
    store's writes on the ``io`` threads, at most :data:`WRITES_AHEAD` per I/O thread queued, so
    that the store always has writes to do while the next pieces are hashed (on the development
    VM, hashing and writing on the same four threads left the disk idle a quarter of the time).
    :meth:`drain` waits for the writes and raises the first failure."""

    def __init__(self, repo: Repository, cache: ChunkCache, codec: ObjectCodec,
                 compression: CompressionPolicy, io: ThreadPoolExecutor, io_threads: int,
                 created: set[str], pack_bytes: int = 0) -> None:
        self.store = repo.store
        #: the keys of the chunks this snapshot writes that the store lacked (not those it
        #: writes again over a damaged copy): what a failed snapshot may remove
        self.created = created
        self.cache = cache
        self.codec = codec
        self.compression = compression
        self.io = io
        self.lock = threading.Lock()
        self.stored_bytes = 0  # what the new chunks take in the store (after compression)
        self._window = threading.BoundedSemaphore(WRITES_AHEAD * io_threads)
        self._writes: list[Future[None]] = []
        self._failed: BaseException | None = None  # the first write's failure

        #: digest of each piece, when hashed ahead (batch mode), and the chunks the store lacks
        self.named: dict[int, str] = {}
        self.lacking: set[str] | None = None
        #: pieces under a chunk's size go into packs (chain/packs.py), new ones and carried ones
        #: (written again to let an old pack die) apart; none where ``pack_bytes`` is 0
        self.chunk_bytes = knobs.get().chunk_bytes
        self.packs = PackBuilder(pack_bytes, self._queue_pack) if pack_bytes > 0 else None
        self.carry = PackBuilder(pack_bytes, self._queue_pack) if pack_bytes > 0 else None

    def packed(self, piece: memoryview) -> bool:
        """Whether ``piece`` goes into a pack (under a chunk's size, packs on)."""
        return self.packs is not None and len(piece) < self.chunk_bytes

    def ask_in_one_batch(self, pieces: list[memoryview], known: list[str | None],
                         pool: ThreadPoolExecutor) -> None:
        """Hash every piece now and ask the store once which chunks it lacks (a server: one
        round trip per snapshot instead of one per chunk)."""
        digests = list(pool.map(lambda p, d: d or self.codec.name(p), pieces, known))
        self.named = {id(p): d for p, d in zip(pieces, digests, strict=True)}
        with self.lock:
            candidates = sorted({layout.chunk_key(d) for p, d in zip(pieces, digests, strict=True)
                                 if d not in self.cache.digests and not self.packed(p)})
        self.lacking = set(self.store.missing(candidates))

    def __call__(self, batch: list[tuple[memoryview, tuple[str, int] | None, str | None, bool]]
                 ) -> list[tuple[ChunkRef, int]]:
        """Name each ``(piece, kind, known, carry)`` of ``batch`` (``known``: its digest, from
        the last snapshot of the same bytes; ``carry``: write it again, into a pack of carried
        pieces) and queue the writes of those the store lacks, together. Returns each piece's
        reference and the bytes written for it.

        A batch is one large piece or several small ones: small chunks are asked about and
        written in one store call each way, not one per chunk (a model's many small tensors);
        with packs, small pieces are placed into the open pack instead (chain/packs.py)."""
        failed = self._failed
        if failed is not None:  # a write failed: the snapshot fails with its error, at once
            raise failed
        digests = [known or self.named.get(id(piece)) or self.codec.name(piece)
                   for piece, _, known, _ in batch]
        claimed: list[int] = []  # indexes of the pieces this call writes unless stored
        placing: list[int] = []  # indexes of the pieces this call places into a pack
        replace: set[int] = set()
        out = [(ChunkRef(d, len(p)), 0) for d, (p, *_) in zip(digests, batch, strict=True)]
        with self.lock:
            for i, d in enumerate(digests):
                piece, _, _, carry = batch[i]
                if self.packed(piece):
                    where = None if carry else self.cache.packed.get(d)
                    if where is not None and where.nbytes == len(piece):
                        out[i] = (where, 0)
                    elif carry or d not in self.cache.digests:  # (else: its chunk object)
                        placing.append(i)
                    continue
                if d in self.cache.digests:
                    continue
                self.cache.digests.add(d)  # claimed: a twin piece in this snapshot skips it
                claimed.append(i)
                if d in self.cache.suspect:
                    replace.add(i)
        for i in placing:  # framed or sealed as its chunk object would be, then placed
            piece, kind, _, carry = batch[i]
            d = digests[i]
            builder = self.carry if carry else self.packs
            assert builder is not None
            ref = builder.place(d, len(piece), self.codec.chunk(
                layout.chunk_key(d), piece, self.compression.encode(kind, piece)))
            with self.lock:
                self.cache.packed[d] = ref  # a twin placed later refers to this one
            out[i] = (ref, len(piece))
        if not claimed:
            return out
        items: list[tuple[str, str, memoryview, bytes | None]] = []
        try:
            keys = {i: layout.chunk_key(digests[i]) for i in claimed}
            asked = [keys[i] for i in claimed if i not in replace]
            if self.lacking is not None:
                lacking = self.lacking
            elif len(asked) == 1:
                lacking = set() if self.store.has(asked[0]) else set(asked)
            else:
                lacking = set(self.store.missing(asked)) if asked else set()
            for i in claimed:
                if i in replace or keys[i] in lacking:
                    piece, kind, _, _ = batch[i]
                    items.append((digests[i], keys[i], piece,
                                  self.compression.encode(kind, piece)))
                    out[i] = (out[i][0], len(piece))
            with self.lock:  # before the write: a write that fails part-way is counted too
                self.created.update(keys[i] for i in claimed
                                    if keys[i] in lacking and i not in replace)
            if items:
                self._queue(items)
        except BaseException:  # nothing queued: unclaimed, a later snapshot writes them
            with self.lock:
                self.cache.digests.difference_update(digests[i] for i in claimed)
            raise
        return out

    def _queue(self, items: list[tuple[str, str, memoryview, bytes | None]]) -> None:
        self._window.acquire()
        try:
            write = self.io.submit(self._put, items)
        except BaseException:  # acquired, but not handed to a write that releases it
            self._window.release()
            raise
        with self.lock:
            self._writes.append(write)

    def _put(self, items: list[tuple[str, str, memoryview, bytes | None]]) -> None:
        try:
            chunks = []
            for _, key, piece, encoded in items:
                failpoint("chunk.put")  # each chunk's write, as the tests count them
                chunks.append((key, self.codec.chunk(key, piece, encoded)))
            self.store.put_many(chunks, durable=False)  # made durable by the sync
            with self.lock:
                for d, _, piece, encoded in items:
                    self.stored_bytes += len(piece) if encoded is None else len(encoded)
                    self.cache.suspect.discard(d)
        except BaseException as e:
            with self.lock:
                self.cache.digests.difference_update(d for d, *_ in items)
                if self._failed is None:
                    self._failed = e
            raise
        finally:
            self._window.release()

    def _queue_pack(self, key: str, parts: list[Buffer], digests: list[str], size: int) -> None:
        """Queue one full pack's write (called by the builders, on a naming thread)."""
        with self.lock:  # before the write: a write that fails part-way is counted too
            self.created.add(key)
            self.cache.pack_bytes[layout.pack_name(key) or ""] = size
        self._window.acquire()
        try:
            write = self.io.submit(self._put_pack, key, parts, digests, size)
        except BaseException:
            self._window.release()
            raise
        with self.lock:
            self._writes.append(write)

    def _put_pack(self, key: str, parts: list[Buffer], digests: list[str], size: int) -> None:
        try:
            failpoint("chunk.put")  # a pack's write, as the tests count them
            self.store.put(key, parts, durable=False)  # made durable by the sync
            with self.lock:
                self.stored_bytes += size
                self.cache.suspect.difference_update(digests)
        except BaseException as e:
            with self.lock:
                for d in digests:
                    ref = self.cache.packed.get(d)
                    if ref is not None and ref.pack == layout.pack_name(key):
                        del self.cache.packed[d]  # not stored: the next snapshot places it
                if self._failed is None:
                    self._failed = e
            raise
        finally:
            self._window.release()

    def drain(self) -> None:
        """Wait for every queued write (the open packs handed over first); raise the first
        failure."""
        for builder in (self.packs, self.carry):
            if builder is not None:
                builder.flush()
        with self.lock:
            writes, self._writes = self._writes, []
        for write in writes:
            write.exception()  # wait for all before raising: none is left running
        for write in writes:
            write.result()


#: Writes queued per I/O thread while the naming threads run ahead.
WRITES_AHEAD = 2


def naming_threads() -> int:
    """Threads that hash (and compress) pieces: the writer threads, on at most as many cores as
    the process may use (more only take turns on the cores)."""
    return max(1, min(knobs.get().write_threads, usable_cores()))


