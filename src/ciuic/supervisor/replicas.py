"""Replicas of other nodes' chunks in this node's memory (:mod:`ciuic.supervisor.peers`).

A replica is what one source node published at its latest commit, chunk by chunk, kept in
``memfd`` *segments*: each transfer writes the chunks the previous replica of that source did
not hold into one new segment, and the chunks it did hold are kept where they are. A replica
serves only once every chunk arrived and matched its digest; it then replaces the previous one
of its source, and segments no replica uses any more are closed. A replica in transit counts
against the budget from its start (its new segment's bytes), so that transfers side by side
cannot together pass it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ciuic.format.chunks import HEADER_BYTES as SKEW
from ciuic.format.digest import digest
from ciuic.supervisor.peers import Receiving

_keys = itertools.count(1)
_DROPPED = "the replica was dropped to keep this node's own copy within --host-memory"


def said_level(told: dict[int, bool], node: int, sent: bool) -> int:
    """How loud ``ciuic run`` says that its snapshot's replica was ``sent`` to node ``node`` (or
    not): INFO the first time and whenever that changes (sent after a failure, failed after
    being sent), else DEBUG (every snapshot of every node would say it again). ``told``: the
    last outcome said per node, updated."""
    was, told[node] = told.get(node), sent
    return logging.DEBUG if was is sent else logging.INFO


class Segment:
    """A memfd holding received chunks, past ``SKEW`` bytes as a rank's staging buffers
    (so the node's ranks map both alike)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.key = next(_keys)
        self.fd = os.memfd_create("ciuic-replica", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, SKEW + nbytes)
            self.region = mmap.mmap(self.fd, SKEW + nbytes)
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        os.close(self.fd)
        with contextlib.suppress(BufferError):  # a view still in use: unmapped when it goes
            self.region.close()


@dataclass(frozen=True)
class Placed:
    segment: Segment
    offset: int  # past the segment's SKEW
    nbytes: int


@dataclass
class Replica:
    src: int
    sid: str
    chunks: dict[str, Placed]


class Replicas:
    """Every complete replica this node holds, by source node, within a memory budget.

    ``room(n)``: whether ``n`` more bytes fit the node's budget (the holder's buffers count
    too); ``keys``: the name keys a sealed store's chunks may be named with.
    """

    def __init__(self, room: Callable[[int], bool], lock: threading.Lock) -> None:
        self._room = room
        self._lock = lock  # the holder's
        self.by_src: dict[int, Replica] = {}
        self.keys: list[bytes] = []
        self.received = 0  # complete replicas
        self.abandoned = 0
        self._transit: set[_Receiving] = set()  # replicas in transit, counted in held()

    def held(self) -> int:
        """Bytes of every segment in use, and of the replicas in transit (call with the lock
        held)."""
        return (sum(s.nbytes for s in self._segments())
                + sum(r.nbytes for r in self._transit))

    def _segments(self) -> set[Segment]:
        return {p.segment for r in self.by_src.values() for p in r.chunks.values()}

    def locate(self, d: str) -> Placed | None:
        for r in self.by_src.values():
            p = r.chunks.get(d)
            if p is not None:
                return p
        return None

    def begin(self, src: int, sid: str, entries: list[tuple[str, int]]) -> Receiving:
        with self._lock:
            prev = self.by_src.get(src)
            kept = {d: prev.chunks[d] for d, n in entries
                    if prev is not None and d in prev.chunks and prev.chunks[d].nbytes == n}
            missing = list(dict.fromkeys((d, n) for d, n in entries if d not in kept))
            need = sum(n for _, n in missing)
            if not self._room(need):
                raise ValueError(f"a replica of node {src} needs {need} more bytes than the "
                                 "host-memory budget (ciuic run --host-memory) leaves")
            receiving = _Receiving(self, src, sid, kept, missing)
            self._transit.add(receiving)
        return receiving

    def _ended(self, receiving: _Receiving) -> None:
        with self._lock:
            self._transit.discard(receiving)

    def _dropped(self, receiving: _Receiving) -> bool:
        """Whether a replica in transit was dropped (:meth:`clear`) to make room."""
        with self._lock:
            return receiving not in self._transit

    def complete(self, replica: Replica, receiving: _Receiving) -> None:
        with self._lock:
            if receiving not in self._transit:
                raise ValueError(_DROPPED)
            self._transit.discard(receiving)
            before = self._segments()
            self.by_src[replica.src] = replica
            for segment in before - self._segments():
                segment.close()
            self.received += 1

    def clear(self) -> None:
        """Drop every replica, and those in transit (their next chunk is refused; call with
        the lock held)."""
        for segment in self._segments():
            segment.close()
        self.by_src.clear()
        self._transit.clear()

    def close(self) -> None:
        with self._lock:
            self.clear()


class _Receiving(Receiving):
    def __init__(self, owner: Replicas, src: int, sid: str, kept: dict[str, Placed],
                 missing: list[tuple[str, int]]) -> None:
        self._owner = owner
        self._src, self._sid = src, sid
        self.missing = missing
        self.nbytes = sum(n for _, n in missing)
        self._segment = Segment(self.nbytes)
        self._at: dict[str, int] = {}
        self._sizes = dict(missing)
        pos = 0
        for d, n in missing:
            self._at[d] = pos
            pos += n
        self._chunks = dict(kept)
        self._done = False

    def buffer(self, d: str, n: int) -> memoryview:
        if self._done:
            raise ValueError("the replica was abandoned")
        if self._owner._dropped(self):
            raise ValueError(_DROPPED)
        at = self._at.get(d)
        if at is None or self._sizes.get(d) != n:
            raise ValueError(f"chunk {d[:12]} of {n} bytes is not part of this replica")
        return memoryview(self._segment.region)[SKEW + at:SKEW + at + n]

    def arrived(self, d: str, view: memoryview) -> None:
        if digest(view) != d and not any(digest(view, key=k) == d for k in self._owner.keys):
            raise ValueError(f"chunk {d[:12]} arrived with other bytes than its digest names")
        self._chunks[d] = Placed(self._segment, self._at[d], len(view))

    def complete(self) -> None:
        lacking = [d for d, _ in self.missing if d not in self._chunks]
        if lacking:
            raise ValueError(f"the replica lacks {len(lacking)} chunks")
        self._owner.complete(Replica(self._src, self._sid, self._chunks), self)
        self._done = True
        if not any(p.segment is self._segment for p in self._chunks.values()):
            self._segment.close()  # every chunk was kept from the previous replica

    def abandon(self) -> None:
        if not self._done:
            self._done = True
            self._owner.abandoned += 1
            self._owner._ended(self)
            self._segment.close()
