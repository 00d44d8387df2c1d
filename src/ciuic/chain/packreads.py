"""A restore's reads of pieces in packs, coalesced into few ranged reads (format.md, "Packs").

Read one at a time, a rank's packed pieces would cost a request each: a pack of 4 MiB holds
hundreds of shards at a large world size, and a cold restore of every rank would again be
request-bound (issue #45). A restore knows every piece it will read before it reads one, so
:class:`PackRuns` groups them by pack, sorts them by offset and merges neighbours into *runs*:
pieces at most :data:`RUN_GAP_BYTES` apart (the bytes between them are read and dropped), up to
:data:`RUN_MAX_BYTES` a run. The first piece of a run that is read fetches the whole run with
one ranged read; every piece is then checked from those bytes exactly as a piece read alone is
(framed or sealed under its chunk key, its plaintext hashed against its digest), and the run's
bytes are dropped once its last piece is taken.

Nothing about a damaged or missing pack changes: a piece that fails its check, or a run that
could not be read, is read alone by :func:`~ciuic.chain.read.read_piece`, which reads the other
copies of a mirror, repairs, and names the pack and the offset in its error.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ciuic.chain.read import check_chunk_blob, read_piece
from ciuic.chain.repo import Repository
from ciuic.errors import IntegrityError, StoreError
from ciuic.format import layout
from ciuic.format.descriptor import ChunkRef

#: Pieces of a pack at most this far apart are read in one request, the bytes between them
#: read and dropped: on an object store a request costs what some hundreds of KiB take to
#: transfer; on a local disk a read of 256 KiB costs about what a second system call does.
RUN_GAP_BYTES = 256 * 1024
#: A run holds at most this many bytes: several runs of one pack read in parallel, and no
#: answer reaches the server's cap of 64 MiB per ranged read.
RUN_MAX_BYTES = 16 * 1024 * 1024


class _Run:
    """A stretch of one pack: ``[start, end)``, the pieces registered in it, its bytes once
    read (until its last piece is taken)."""

    __slots__ = ("data", "end", "failed", "key", "left", "lock", "start")

    def __init__(self, key: str, start: int, end: int) -> None:
        self.key, self.start, self.end = key, start, end
        self.left = 0  # pieces registered and not yet taken
        self.data: memoryview | None = None
        self.failed = False  # the run's read failed: its pieces are read alone
        self.lock = threading.Lock()


class PackRuns:
    """The runs of one restore's packed pieces (``refs``: every reference it will read, in any
    order, repeats counted); :meth:`read` serves each of them. Thread-safe."""

    def __init__(self, repo: Repository, refs: Iterable[ChunkRef],
                 gap: int = RUN_GAP_BYTES, most: int = RUN_MAX_BYTES) -> None:
        self.repo = repo
        self._runs: dict[tuple[str, int], _Run] = {}
        by_pack: dict[str, dict[int, int]] = {}  # pack -> offset -> stored bytes
        count: dict[tuple[str, int], int] = {}
        for ref in refs:
            if ref.pack is None:
                continue
            by_pack.setdefault(ref.pack, {})[ref.offset] = ref.stored
            count[ref.pack, ref.offset] = count.get((ref.pack, ref.offset), 0) + 1
        for pack, pieces in by_pack.items():
            key = layout.pack_key(pack)
            run: _Run | None = None
            for offset in sorted(pieces):
                end = offset + pieces[offset]
                if run is None or offset - run.end > gap or end - run.start > most:
                    run = _Run(key, offset, end)
                run.end = max(run.end, end)
                run.left += count[pack, offset]
                self._runs[pack, offset] = run
        #: ranged reads made (the restore's request count)
        self.requests = 0
        self._lock = threading.Lock()

    @property
    def runs(self) -> int:
        """How many runs the registered pieces make (the requests a cold restore makes)."""
        return len({id(r) for r in self._runs.values()})

    def read(self, ref: ChunkRef, dest: memoryview) -> None:
        """Piece ``ref`` (in a pack) into ``dest``, checked: from its run's bytes (fetched now
        if this is the run's first piece), else read alone."""
        assert ref.pack is not None
        run = self._runs.get((ref.pack, ref.offset))
        blob = self._take(run, ref) if run is not None else None
        if blob is not None:
            key = layout.chunk_key(ref.digest)
            try:
                check_chunk_blob(self.repo, key, blob, ref.digest, ref.nbytes, dest)
                return
            except IntegrityError:
                pass  # read alone below: its error names the pack, a mirror repairs it
        read_piece(self.repo, ref, dest)

    def _take(self, run: _Run, ref: ChunkRef) -> memoryview | None:
        """The piece's stored bytes from its run (None: the run could not be read, or does not
        hold them)."""
        with run.lock:
            if run.data is None and not run.failed:
                run.data = self._fetch(run)
                run.failed = run.data is None
            data = run.data
            run.left -= 1
            if run.left <= 0:
                run.data = None  # a repeat read past the count fetches again
                run.failed = False
        if data is None:
            return None
        lo, hi = ref.offset - run.start, ref.offset - run.start + ref.stored
        return data[lo:hi] if lo >= 0 and hi <= len(data) else None

    def _fetch(self, run: _Run) -> memoryview | None:
        buf = bytearray(run.end - run.start)
        try:
            size = self.repo.store.get_into(run.key, [memoryview(buf)], run.start)
        except (StoreError, IntegrityError):
            return None  # missing or unreachable: each piece says so when read alone
        with self._lock:
            self.requests += 1
        return memoryview(buf)[:max(0, min(size - run.start, len(buf)))]
