"""Packs: a snapshot's small pieces in a few objects, not one object each (format.md, "Packs").

A tensor is cut into chunks of ``chunk_bytes``; a piece smaller than that (a small tensor, a
tensor's last piece, a rank's shard of a sharded tensor at a large world size) would otherwise be
an object of its own: thousands per rank, each a file to create and fsync or a PUT to pay for
(on the development VM a new file and its first write cost 0.75 ms, an append 0.025 ms; on S3 a
request each). The writer places such pieces, each framed or sealed exactly as its chunk object
would be (under its chunk key, so a sealed piece cannot be moved to another digest), one after
another into a pack of about ``pack_bytes``, and the chunk reference records where: the pack's
name, the piece's offset in it and the bytes it takes there. A reader reads those bytes alone
(a ranged read) and checks them as it would the chunk object.

A pack is named by 32 random bytes, not by its content: a piece's reference must be known when
the piece is placed, before the pack is full. Its pieces are what is content-addressed, each
checked against its digest on every read.

Bodies and their references never change after the commit (the manifest names the body by its
digest), so a pack is never rewritten: gc deletes a pack once no snapshot references any piece
in it. What bounds the space that dead pieces hold in live packs is the writer: a snapshot that
would reference less than :data:`CARRY_BELOW` of a pack's bytes writes those pieces again into a
pack of their own (they were unchanged: they tend to stay so) instead of referencing the old
pack, which dies with the older snapshots (see :func:`carried`).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Sequence

from ciuic.format import layout
from ciuic.format.descriptor import ChunkRef
from ciuic.format.digest import Buffer

#: a snapshot that references less than this fraction of a pack's bytes writes the pieces it
#: references again (into a pack of carried pieces), so that the old pack can die
CARRY_BELOW = 0.5

#: (pack key, its buffers, the digests of its pieces, its bytes): queue the pack's write
PutPack = Callable[[str, list[Buffer], list[str], int], None]


class PackBuilder:
    """Places pieces one after another into the open pack; hands each pack to ``put`` once it
    holds ``target`` bytes or more (and the last one at :meth:`flush`). Thread-safe: the naming
    threads place their pieces under one lock (a copy of a few buffer references), so that a
    snapshot makes one partly filled pack, not one per thread."""

    def __init__(self, target: int, put: PutPack) -> None:
        self.target = target
        self._put = put
        self._lock = threading.Lock()
        self._name: str | None = None
        self._parts: list[Buffer] = []
        self._digests: list[str] = []
        self._size = 0

    def place(self, d: str, nbytes: int, framed: Sequence[Buffer]) -> ChunkRef:
        """Place the piece of digest ``d`` (``nbytes`` of plaintext), stored as ``framed`` (its
        frame header and payload, or its sealed parts); returns its reference."""
        stored = sum(memoryview(b).nbytes for b in framed)
        with self._lock:
            if self._name is None:
                self._name = secrets.token_hex(32)
            ref = ChunkRef(d, nbytes, self._name, self._size, stored)
            self._parts.extend(framed)
            self._digests.append(d)
            self._size += stored
            full = self._take() if self._size >= self.target else None
        if full is not None:
            self._put(*full)
        return ref

    def flush(self) -> None:
        """Hand the partly filled pack, if any, to ``put``."""
        with self._lock:
            last = self._take() if self._name is not None else None
        if last is not None:
            self._put(*last)

    def _take(self) -> tuple[str, list[Buffer], list[str], int]:
        assert self._name is not None
        out = (layout.pack_key(self._name), self._parts, self._digests, self._size)
        self._name, self._parts, self._digests, self._size = None, [], [], 0
        return out


def carried(refs: Sequence[ChunkRef | None], pack_bytes: dict[str, int]) -> set[int]:
    """The indexes of ``refs`` (a snapshot's reused pieces, in order; None: not reused) to
    write again: those in packs of which the snapshot would reference less than
    :data:`CARRY_BELOW` of the bytes. A pack whose size is not known (written by another
    process) is referenced as it is."""
    used: dict[str, int] = {}
    for ref in refs:
        if ref is not None and ref.pack is not None:
            used[ref.pack] = used.get(ref.pack, 0) + ref.stored
    thin = {p for p, n in used.items() if p in pack_bytes and n < CARRY_BELOW * pack_bytes[p]}
    return {i for i, ref in enumerate(refs)
            if ref is not None and ref.pack is not None and ref.pack in thin}
