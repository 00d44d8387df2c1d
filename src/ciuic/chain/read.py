"""Verified reads of stored objects: a snapshot's manifest and body, and its chunks.

Every byte is checked before use: the manifest against its ID, the body against the manifest,
each chunk against its name and length. Damage raises :class:`~ciuic.errors.CorruptObject`
naming the object; a missing object raises it too (as "missing"). Never unpickles.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ciuic.chain.repo import Repository
from ciuic.errors import CorruptObject, IntegrityError, ObjectNotFound, UnreadableObject
from ciuic.format import chunks as ck
from ciuic.format import layout
from ciuic.format import manifest as mf
from ciuic.format.boxes import BoxTable, listed_boxes
from ciuic.format.crypto import SEALED_OVERHEAD
from ciuic.format.descriptor import ChunkRef, TensorDescriptor, parse_chunk
from ciuic.format.digest import Buffer, digest
from ciuic.format.info import SnapshotInfo
from ciuic.format.parts import BodyPart, listed_parts, merge
from ciuic.format.tree import walk_leaves
from ciuic.store import Store

#: Reads in flight at once: a cold read waits on the disk, not a core, so it is an I/O depth, not
#: a core count (a cold 1 GiB restore on the 2-core VM: 1.06 s with 16 against 1.16 s with 4,
#: medians of 4, interleaved; BLAKE3 and the reads release the GIL).
READ_THREADS = 16

T = TypeVar("T")
log = logging.getLogger("ciuic")


def read_body(repo: Repository, info: SnapshotInfo, *, parts: bool = True
              ) -> tuple[mf.Manifest, dict[str, Any]]:
    """The verified manifest and body trees of a snapshot. ``parts=False``: a split body's
    index alone (its sharded descriptors ``"split"``, no ``ranks``; see :class:`Parts`).

    Where the catalog names the body (``info.body``), the manifest and the body are read at
    once: on an object store each is a round trip (a cold restart of every rank waits on
    them). The body then counts only if the manifest, verified, names that body, of that size;
    otherwise it is read again as the manifest says."""
    if not info.body:
        m = repo.read_manifest(info.project, info.job, info.id)
        return m, body_states(repo, m, parts=parts)
    with ThreadPoolExecutor(1, thread_name_prefix="ciuic-read") as pool:
        early = pool.submit(_body_blob, repo, info.project, info.job, info.body)
        m = repo.read_manifest(info.project, info.job, info.id)  # its errors first
        try:
            found = early.result()
        except Exception as e:  # read again below, where the nearest intact copy is found
            log.debug("reading the body of %s with its manifest failed: %s", info.short_id, e)
            found = None
    if found is None or m.body != info.body or len(found[0]) != m.body_bytes:
        return m, body_states(repo, m, parts=parts)
    key = layout.body_key(m.project, m.job, m.body)
    try:
        states = mf.decode_body(found[0], key, m.body, found[1])
    except IntegrityError as e:  # the nearest copy may be damaged: a mirror has another
        log.debug("%s: %s; reading it again", key, e)
        return m, body_states(repo, m, parts=parts)
    return m, _with_parts(repo, m, states, key, parts)


def _body_blob(repo: Repository, project: str, job: str, body: str) -> tuple[bytes, bytes | None]:
    """A body's bytes as the store holds them, opened (unchecked), and its name key."""
    key = layout.body_key(project, job, body)
    blob = repo.preloaded(key)
    return repo.open_meta(key, blob if blob is not None else repo.store.get(key))


def body_states(repo: Repository, m: mf.Manifest, *, parts: bool = True) -> dict[str, Any]:
    """The verified states of a manifest's body, a split body's parts merged in (unless
    ``parts`` is False). ObjectNotFound when it was pruned."""
    key = layout.body_key(m.project, m.job, m.body)

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

    return _with_parts(repo, m, repo.read_verified(key, read), key, parts)


def _with_parts(repo: Repository, m: mf.Manifest, states: dict[str, Any], key: str,
                parts: bool) -> dict[str, Any]:
    if parts:
        listed = _listed(states, key)
        if listed is not None:
            merge(states, Parts(repo, m, listed).all(), key)
    return states


@contextlib.contextmanager
def damaged_body(key: str) -> Iterator[None]:
    """Inside: an :class:`IntegrityError` that names no object (a malformed tree, descriptor or
    inline value in a body: ``format.tree``, ``restore.leaves``) is the body's
    :class:`CorruptObject`, so that a reader (the server's routes, ``ciuic inspect``, ``diff``)
    tells it as it tells any damage."""
    try:
        yield
    except UnreadableObject:
        raise
    except IntegrityError as e:
        raise CorruptObject(key, str(e)) from e


def checked_leaves(states: dict[str, Any], key: str) -> list[tuple[str, str, dict[str, Any]]]:
    """Every tensor of a body's states (``dist`` aside) as (path, kind, descriptor), the tree and
    each descriptor checked: :class:`CorruptObject` naming the body ``key`` where one is
    malformed, so that what follows may read the descriptors' fields as they are typed."""
    with damaged_body(key):
        found = walk_leaves({k: v for k, v in states.items() if k != "dist"})
        for path, _kind, desc in found:
            TensorDescriptor.from_json(desc, path)
    return found


def body_keys(m: mf.Manifest, states: dict[str, Any]) -> list[str]:
    """The objects that hold a snapshot's body: the body (a split body's index), then its
    parts, then its box table."""
    key = layout.body_key(m.project, m.job, m.body)
    listed = list(_listed(states, key) or [])
    table = _table(states, key)
    if table is not None:
        listed.append(table)
    return [key, *(layout.body_key(m.project, m.job, d) for d, _ in listed)]


def _table(states: dict[str, Any], key: str) -> tuple[str, int] | None:
    try:
        return listed_boxes(states)
    except CorruptObject as e:
        raise CorruptObject(key, e.reason) from None


def _listed(states: dict[str, Any], key: str) -> list[tuple[str, int]] | None:
    try:
        return listed_parts(states)
    except CorruptObject as e:
        raise CorruptObject(key, e.reason) from None


class Parts:
    """A split body's parts (docs/format.md, body format 3), each read and verified once, on
    demand: a rank restoring on the layout it saved reads its own (and those it names)."""

    def __init__(self, repo: Repository, m: mf.Manifest, listed: list[tuple[str, int]],
                 table: tuple[str, int] | None = None) -> None:
        self.repo, self.m, self.listed = repo, m, listed
        #: the box table the index names (format/boxes.py), if any
        self.table = table
        self._read: dict[int, BodyPart] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, repo: Repository, m: mf.Manifest, states: dict[str, Any]) -> Parts | None:
        """The parts of a split body's index ``states``; None for a body in one piece."""
        key = layout.body_key(m.project, m.job, m.body)
        listed = _listed(states, key)
        return None if listed is None else cls(repo, m, listed, _table(states, key))

    def boxes(self) -> BoxTable | None:
        """The box table, read and verified; None where the index names none."""
        if self.table is None:
            return None
        return self._named(*self.table, "the box table", BoxTable.decode)

    def _named(self, d: str, n: int, what: str,
               decode: Callable[[bytes, str, str, bytes | None], T]) -> T:
        """The body's object ``d`` of ``n`` bytes (``what`` it is), opened, checked against
        its name and decoded, from the nearest intact copy."""
        key = layout.body_key(self.m.project, self.m.job, d)

        def read(store: Store) -> T:
            try:
                blob = store.get(key)
            except ObjectNotFound:
                raise CorruptObject(key, f"missing ({what} of the body of the snapshot at "
                                         f"step {self.m.step})") from None
            data, name_key = self.repo.open_meta(key, blob)
            if len(data) != n:
                raise CorruptObject(key, f"size {len(data)} differs from the body's {n}")
            return decode(data, key, d, name_key)

        return self.repo.read_verified(key, read)

    def __len__(self) -> int:
        return len(self.listed)

    @property
    def count(self) -> int:
        """The parts read so far."""
        return len(self._read)

    def get(self, rank: int) -> BodyPart:
        with self._lock:
            part = self._read.get(rank)
        if part is None:
            part = self._fetch(rank)
            with self._lock:
                self._read[rank] = part
        return part

    def all(self) -> list[BodyPart]:
        return self.some(range(len(self.listed)))

    def some(self, ranks: Iterable[int]) -> list[BodyPart]:
        """These ranks' parts, in parallel, in the order given."""
        ranks = list(ranks)
        if any(not 0 <= r < len(self.listed) for r in ranks):
            raise CorruptObject(layout.body_key(self.m.project, self.m.job, self.m.body),
                                f"names a part of rank {max(ranks)} of {len(self.listed)}")
        todo = [r for r in ranks if r not in self._read]
        if len(todo) > 1:
            with ThreadPoolExecutor(min(READ_THREADS, len(todo)),
                                    thread_name_prefix="ciuic-read") as pool:
                list(pool.map(self.get, todo))
        return [self.get(r) for r in ranks]

    def _fetch(self, rank: int) -> BodyPart:
        d, n = self.listed[rank]
        part = self._named(d, n, f"rank {rank}'s part", BodyPart.decode)
        key = layout.body_key(self.m.project, self.m.job, d)
        if part.rank != rank:
            raise CorruptObject(key, f"rank {rank}'s part of the body says it is rank "
                                     f"{part.rank}'s")
        return part


def read_chunk(repo: Repository, d: str, n: int, dest: memoryview,
               ref: ChunkRef | None = None) -> None:
    """Read chunk ``d`` (plaintext length ``n``) straight into ``dest`` and verify it; where
    ``ref`` places it inside a pack, only its bytes there (:func:`read_piece`)."""
    if ref is not None and ref.pack is not None:
        read_piece(repo, ref, dest)
        return
    key = layout.chunk_key(d)
    sealed = bool(repo.keyring.keys)  # a store read with keys holds sealed objects

    def read(store: Store) -> None:
        try:
            if sealed:
                _read_sealed(repo, store, key, d, n, dest)
                return
            header = bytearray(ck.HEADER_BYTES)
            size = store.get_into(key, [memoryview(header), dest])
            if ck.is_sealed(header):
                check_chunk_blob(repo, key, store.get(key), d, n, dest)
                return
        except ObjectNotFound:
            raise CorruptObject(key, "missing") from None
        ck.check_read(key, header, size, dest, d, n)

    repo.read_verified(key, read)


def read_piece(repo: Repository, ref: ChunkRef, dest: memoryview) -> None:
    """Read the piece ``ref`` places inside a pack (its ``stored`` bytes from ``offset``: one
    ranged read) into ``dest`` and check it as a chunk object of its own: framed or sealed
    under its chunk key, its plaintext hashed against its digest. A damaged piece is a
    :class:`CorruptObject` of its chunk key (what a restore distrusts and verify reports),
    saying where in which pack it lies."""
    assert ref.pack is not None
    pack = layout.pack_key(ref.pack)
    key = layout.chunk_key(ref.digest)  # what sealed it (associated data) and names it

    def read(store: Store) -> None:
        blob = bytearray(ref.stored)
        try:
            size = store.get_into(pack, [memoryview(blob)], ref.offset)
        except ObjectNotFound:
            raise CorruptObject(key, f"its pack {pack} is missing") from None
        if size < ref.offset + ref.stored:
            raise CorruptObject(key, f"its pack {pack} holds {size} bytes, not the "
                                     f"{ref.offset + ref.stored} its place needs (truncated?)")
        try:
            check_chunk_blob(repo, key, memoryview(blob), ref.digest, ref.nbytes, dest)
        except CorruptObject as e:
            raise CorruptObject(key, f"{e.reason} (at byte {ref.offset} of {pack})") from e

    repo.read_verified(pack, read)


_SCRATCH = threading.local()


def _read_sealed(repo: Repository, store: Store, key: str, d: str, n: int,
                 dest: memoryview) -> None:
    """A chunk expected sealed: the whole object in one read into this thread's scratch buffer
    (reused, so its pages are warm), then decrypted straight into ``dest`` and checked."""
    want = n + SEALED_OVERHEAD
    scratch: bytearray | None = getattr(_SCRATCH, "buffer", None)
    if scratch is None or len(scratch) < want:
        scratch = _SCRATCH.buffer = bytearray(want)
    blob = memoryview(scratch)[:want]
    size = store.get_into(key, [blob])
    check_chunk_blob(repo, key, blob[:size] if size <= want else store.get(key), d, n, dest)


def take_chunk(repo: Repository, d: str, n: int, dest: memoryview, src: memoryview | None,
               name_key: bytes | None, ref: ChunkRef | None = None) -> bool:
    """Chunk ``d`` from memory that should hold it (the host-memory tier): copy ``src`` into
    ``dest`` (unless ``src`` is None: ``dest`` holds it already) and check it against its name;
    when it differs, read the chunk from the store instead. Returns whether memory served it."""
    if src is not None:
        dest[:] = src
    if digest(dest) == d or (name_key is not None and digest(dest, key=name_key) == d):
        return True
    read_chunk(repo, d, n, dest, ref)
    return False


def check_chunk_blob(repo: Repository, key: str, blob: bytes | memoryview, d: str,
                     n: int | None, dest: memoryview | None = None) -> None:
    """Check a whole stored chunk (plain or sealed) against its name; optionally write its
    plaintext into ``dest`` (of ``n`` bytes: a sealed one is decrypted straight into it).
    ``n``: the expected length (None: the header's)."""
    if not ck.is_sealed(blob[:ck.HEADER_BYTES]):
        framed = memoryview(blob)  # not copied: a run's bytes, checked where they lie
        n = ck.header_length(framed[:ck.HEADER_BYTES]) if n is None else n
        plain = ck.unframe(key, framed, d, n)
        if dest is not None:
            dest[:] = plain
        return
    if dest is not None:
        used = repo.keyring.open_into(key, blob, dest)  # checks the length against dest's
        opened: Buffer = dest
    else:
        opened, used = repo.keyring.open(key, blob)
        if n is not None and len(opened) != n:
            raise CorruptObject(key, f"length {len(opened)} differs from the expected {n}")
    if digest(opened, key=used.name_key) != d:
        raise CorruptObject(key, "content hash does not match its name")


def get_chunk(repo: Repository, ref: ChunkRef) -> None:
    read_chunk(repo, ref.digest, ref.nbytes, memoryview(bytearray(ref.nbytes)), ref)


def chunk_refs(states: dict[str, Any]) -> dict[str, ChunkRef]:
    """digest -> the reference of every chunk a body's states reference (where a digest is
    referenced at several places, one of them: its bytes are the same)."""
    refs: dict[str, ChunkRef] = {}
    for _path, _kind, desc in walk_leaves(states):
        for piece in desc.get("shards", [desc]):
            for c in piece.get("chunks", []):
                ref = parse_chunk(c)
                refs.setdefault(ref.digest, ref)
    return refs


def object_of(ref: ChunkRef) -> str:
    """The store key of the object that holds ``ref``'s bytes: its chunk, or its pack."""
    return layout.chunk_key(ref.digest) if ref.pack is None else layout.pack_key(ref.pack)


def verify_chunks(repo: Repository, refs: dict[str, ChunkRef], deep: bool,
                  pool: ThreadPoolExecutor) -> list[tuple[str, UnreadableObject | None]]:
    """Problems with chunks, as (key, the error, or None for a missing chunk): existence (of
    each chunk object and each pack once), or (``deep``) a full re-read and re-hash of every
    piece. A missing pack is reported under the chunk key of each piece it held."""
    packs: dict[str, bool] = {}
    lock = threading.Lock()

    def present(key: str) -> bool:
        with lock:
            known = packs.get(key)
        if known is None:
            known = repo.store.has(key)
            with lock:
                packs[key] = known
        return known

    def check(ref: ChunkRef) -> tuple[str, UnreadableObject | None] | None:
        key = layout.chunk_key(ref.digest)
        try:
            if deep:
                get_chunk(repo, ref)
            elif not (repo.store.has(key) if ref.pack is None else present(object_of(ref))):
                return key, None
        except UnreadableObject as e:
            return e.key, e
        return None

    return [r for r in pool.map(check, refs.values()) if r is not None]
