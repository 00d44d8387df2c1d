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

Runs are fetched ahead of their pieces' readers (:meth:`PackRuns.start`): in the order their
first pieces were registered (the order a restore reads them), in parallel, as long as the runs
fetched and not yet taken stay within ``read_ahead_bytes``. Without it a restore had about two
reads in flight: the readers of one run's pieces wait on its one read, and a restore reads
neighbouring tensors, which share runs, at once. A run whose first reader comes before its
fetch has started is fetched by that reader, as without read-ahead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

from ciuic import knobs
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

    __slots__ = ("ahead", "data", "end", "failed", "first", "key", "left", "lock", "start")

    def __init__(self, key: str, start: int, end: int, first: int) -> None:
        self.key, self.start, self.end = key, start, end
        self.first = first  # where its first piece came among those registered
        self.left = 0  # pieces registered and not yet taken
        self.data: memoryview | None = None
        self.failed = False  # the run's read failed: its pieces are read alone
        #: its read started ahead of its readers, until its last piece is taken
        self.ahead: Future[memoryview | None] | None = None
        self.lock = threading.Lock()


class PackRuns:
    """The runs of one restore's packed pieces (``refs``: every reference it will read, in any
    order, repeats counted); :meth:`read` serves each of them. Thread-safe."""

    def __init__(self, repo: Repository, refs: Iterable[ChunkRef],
                 gap: int = RUN_GAP_BYTES, most: int = RUN_MAX_BYTES,
                 ahead: int | None = None) -> None:
        self.repo = repo
        self._runs: dict[tuple[str, int], _Run] = {}
        by_pack: dict[str, dict[int, int]] = {}  # pack -> offset -> stored bytes
        count: dict[tuple[str, int], int] = {}
        for ref in refs:
            if ref.pack is None:
                continue
            by_pack.setdefault(ref.pack, {})[ref.offset] = ref.stored
            count[ref.pack, ref.offset] = count.get((ref.pack, ref.offset), 0) + 1
        order = {piece: i for i, piece in enumerate(count)}  # registered first, read first
        for pack, pieces in by_pack.items():
            key = layout.pack_key(pack)
            run: _Run | None = None
            for offset in sorted(pieces):
                end = offset + pieces[offset]
                if run is None or offset - run.end > gap or end - run.start > most:
                    run = _Run(key, offset, end, order[pack, offset])
                run.end = max(run.end, end)
                run.first = min(run.first, order[pack, offset])
                run.left += count[pack, offset]
                self._runs[pack, offset] = run
        #: ranged reads made (the restore's request count)
        self.requests = 0
        self._lock = threading.Lock()
        self._ahead = knobs.get().read_ahead_bytes if ahead is None else ahead
        #: the runs to fetch ahead, in the order they will be read; the next one's index
        self._queue = sorted({id(r): r for r in self._runs.values()}.values(),
                             key=lambda r: r.first)
        self._next = 0
        self._held = 0  # bytes of runs fetched ahead and not yet taken
        self._fetcher: ThreadPoolExecutor | None = None
        self._closed = False

    def start(self) -> None:
        """Start fetching runs ahead of their readers (within ``read_ahead_bytes``)."""
        if self._ahead > 0 and self._queue:
            self._pump()

    def close(self) -> None:
        """Stop fetching ahead: fetches not started are dropped; the pieces of their runs are
        read as without read-ahead. Call once the restore's reads are done (or failed)."""
        with self._lock:
            self._closed = True
            fetcher, self._fetcher = self._fetcher, None
        if fetcher is not None:
            fetcher.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PackRuns:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pump(self) -> None:
        """Start the next runs' fetches while the bytes fetched ahead stay within the bound
        (the first one always: a run larger than the bound is still fetched ahead)."""
        with self._lock:
            while not self._closed and self._next < len(self._queue):
                run = self._queue[self._next]
                size = run.end - run.start
                if self._held and self._held + size > self._ahead:
                    return
                self._next += 1
                if not run.lock.acquire(blocking=False):
                    continue  # its first reader is fetching it
                try:
                    if (run.data is not None or run.failed or run.ahead is not None
                            or run.left <= 0):
                        continue  # being read, or read already
                    if self._fetcher is None:
                        self._fetcher = ThreadPoolExecutor(8, thread_name_prefix="ciuic-ahead")
                    run.ahead = self._fetcher.submit(self._fetch, run)
                    self._held += size
                finally:
                    run.lock.release()

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
        released = False
        with run.lock:
            if run.data is None and not run.failed:
                ahead = run.ahead
                try:
                    run.data = ahead.result() if ahead is not None else self._fetch(run)
                except CancelledError:  # at close, before it started: read now
                    run.data = self._fetch(run)
                run.failed = run.data is None
            data = run.data
            run.left -= 1
            if run.left <= 0:
                run.data = None  # a repeat read past the count fetches again
                run.failed = False
                released, run.ahead = run.ahead is not None, None
        if released:
            with self._lock:
                self._held -= run.end - run.start
            self._pump()
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
