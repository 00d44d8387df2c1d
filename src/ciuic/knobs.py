"""Tunables, in one place. Tests override them with :func:`override`.

Units are in the names. Change defaults only with a measurement that says why.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Knobs:
    #: Tensors are cut into chunks of this many bytes (the last chunk of a tensor is shorter).
    chunk_bytes: int = 4 * 1024 * 1024
    #: Pieces smaller than a chunk are written into packs of about this many bytes, a few
    #: objects per snapshot and rank instead of one each (chain/packs.py; docs/multinode.md:
    #: 0.23 M objects for a 70B model's full snapshot at 16,384 ranks instead of 13.6 M); 0:
    #: each its own object, in the body formats older readers read. Every reader reads packs
    #: whatever it is set to.
    pack_bytes: int = 4 * 1024 * 1024
    #: A restore fetches the runs of its packed pieces (chain/packreads.py) this many bytes
    #: ahead of the pieces being read, in parallel; 0: each run when its first piece is read.
    read_ahead_bytes: int = 32 * 1024 * 1024
    #: A later snapshot asks the kernel which pages of a host tensor that did not change at
    #: the last snapshots were written since (engine/written.py), instead of comparing all of
    #: it with its staging buffer; False: always compare.
    write_watch: bool = True
    #: Threads that hash and write chunks in the background (BLAKE3 and writes release the GIL).
    write_threads: int = 4
    #: The local store writes large objects whose memory lines up with pages (the chunks of
    #: staged tensors) with direct I/O, bypassing the page cache (store/direct.py).
    direct_io: bool = True
    #: Tensors of at most this many bytes are stored inline in the snapshot body.
    inline_max_bytes: int = 256
    #: How often step() records the run's progress (for interruption detection).
    heartbeat_interval_s: float = 2.0
    #: An in-flight save marker older than this is considered abandoned by `gc`.
    inflight_stale_s: float = 6 * 3600.0
    #: How long a save waits for a running `gc` to finish before giving up.
    gc_wait_s: float = 60.0
    #: A gc lock not refreshed for this long belongs to a dead gc (it refreshes every
    #: ``gc_lock_refresh_s`` while it works).
    gc_lock_stale_s: float = 600.0
    gc_lock_refresh_s: float = 30.0
    #: Store calls: attempts for transient errors, timeout per attempt, first backoff.
    store_attempts: int = 3
    store_timeout_s: float = 120.0
    store_backoff_s: float = 0.1
    #: S3: objects above this size go up as multipart uploads (and come back as parallel ranged
    #: GETs) in parts of ``s3_part_bytes``, ``s3_concurrency`` at a time per store; a batch of
    #: small objects goes up, and is asked about, that many at a time too (on a server store:
    #: its PUTs).
    s3_multipart_threshold_bytes: int = 16 * 1024 * 1024
    s3_part_bytes: int = 8 * 1024 * 1024
    s3_concurrency: int = 8
    s3_connect_timeout_s: float = 10.0
    s3_read_timeout_s: float = 60.0
    #: Multi-rank: how long a collective of ciuic's own gloo groups waits for the slowest rank
    #: before it fails (a dead rank usually fails it at once: its connections close).
    dist_timeout_s: float = 600.0
    #: Multi-rank: every this many ``step()`` calls the ranks share, without waiting, whether a
    #: signal arrived or the time interval elapsed (one small all-reduce; 0.3 ms to start on
    #: the development VM). A SIGTERM on one rank stops every rank at most this many steps + 1
    #: later.
    dist_agree_every_steps: int = 10
    #: Temporary files of the local store older than this are removed by `gc`.
    temp_stale_s: float = 3600.0
    #: How much nicer (lower CPU priority, Linux) the threads of an asynchronous snapshot run
    #: than the training thread; 0 keeps them equal. Read when a thread starts; a lowered
    #: thread cannot be raised again. Measured in docs/benchmarks.md ("Background priority"): a
    #: snapshot of the demo model slowed the overlapping training steps by 50 ms at 0, 36 ms at
    #: 10.
    background_nice: int = 10


_current = Knobs()


def get() -> Knobs:
    """The knobs in force."""
    return _current


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Knobs]:
    """Temporarily change knobs: ``with knobs.override(chunk_bytes=1024): ...``."""
    global _current
    names = {f.name for f in fields(Knobs)}
    unknown = set(changes) - names
    if unknown:
        raise TypeError(f"unknown knobs: {sorted(unknown)}; known: {sorted(names)}")
    saved = _current
    _current = replace(_current, **changes)  # type: ignore[arg-type]
    try:
        yield _current
    finally:
        _current = saved
