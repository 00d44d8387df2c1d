"""What the dashboard shows: a snapshot's tensors and their statistics, a check, the diff of
two snapshots, and the loss and norms along a chain."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from ciuic.chain.repo import Repository
from ciuic.chain.verify import verify_job
from ciuic.errors import ApiError
from ciuic.faults import failpoint
from ciuic.format.info import SnapshotInfo
from ciuic.restore import inspect as look
from ciuic.restore.diff import diff, json_safe
from ciuic.words import counted

#: statistics missing from a snapshot written before ciuic recorded them are computed (reading
#: the tensors) for up to this many bytes
STATS_MAX_BYTES = 512 * 1024 * 1024
#: a diff reads the tensors whose bytes differ: at most this many bytes of them
DIFF_MAX_BYTES = 2 * 1024 * 1024 * 1024
_ONE_AT_A_TIME = threading.Semaphore(1)  # reads of whole tensors: never several at once
_ONE_DEEP_CHECK = threading.Semaphore(1)  # re-hashing a snapshot's chunks: one at a time
#: reads of whole tensors (statistics, diffs) admitted at once, the running one included: the
#: others wait for it holding a server thread, so a few, never the server's every thread
READS_ADMITTED = 4
_ADMITTED = threading.BoundedSemaphore(READS_ADMITTED)
_READING: set[str] = set()  # the API keys with a read admitted
_READING_LOCK = threading.Lock()


@contextlib.contextmanager
def _admitted(key_id: str) -> Iterator[None]:
    """Admit one whole-tensor read for the API key ``key_id``, or refuse it at once with 429:
    one read per key at a time (the second is refused, not queued), and at most
    :data:`READS_ADMITTED` in all. Then the reads run one at a time."""
    with _READING_LOCK:
        if key_id in _READING:
            raise ApiError(429, "busy", "this API key is already reading tensors on the server "
                           "(statistics or a diff, one at a time per key); try again when "
                           "that answers")
        if not _ADMITTED.acquire(blocking=False):
            raise ApiError(429, "busy", "the server is reading tensors for other requests; "
                           "try again in a moment")
        _READING.add(key_id)
    try:
        with _ONE_AT_A_TIME:
            failpoint("server.inspect")  # tests: a long read
            yield
    finally:
        with _READING_LOCK:
            _READING.discard(key_id)
            _ADMITTED.release()


def tensors(repo: Repository, info: SnapshotInfo, key_id: str) -> dict[str, Any]:
    """Every tensor of a snapshot (path, dtype, shape, bytes) with its statistics: as the writer
    recorded them (nothing read), else computed for up to ``STATS_MAX_BYTES`` (one read per
    API key ``key_id`` at a time: :func:`_admitted`)."""
    with _admitted(key_id):
        rows = look.tensors(repo, info, compute=True, compute_max_bytes=STATS_MAX_BYTES)
    return {"id": info.id, "step": info.step, "health": info.to_json()["health"],
            "tensors": [r.to_json() for r in rows],
            "stats": all(r.stats is not None or not look.is_float_dtype(r.dtype) for r in rows),
            "computed": any(r.computed for r in rows), "stats_limit_bytes": STATS_MAX_BYTES}


def compare(repo: Repository, a: SnapshotInfo, b: SnapshotInfo, key_id: str) -> dict[str, Any]:
    """``ciuic diff`` of two snapshots of one project, as JSON (floats that are not finite as
    null). Refused when the tensors it would have to read pass ``DIFF_MAX_BYTES``; one read per
    API key ``key_id`` at a time (:func:`_admitted`)."""
    from ciuic.errors import ConfigurationError

    with _admitted(key_id):
        result = diff(repo, a, repo, b, max_read_bytes=DIFF_MAX_BYTES)
        if result is None:
            raise ConfigurationError(
                f"comparing {a.short_id} with {b.short_id} would read more than "
                f"{DIFF_MAX_BYTES >> 30} GiB of tensors; run `ciuic diff {a.short_id} "
                f"{b.short_id}` on a machine that reads the store")
    return result.to_json()


def series(repo: Repository, project: str, job: str) -> dict[str, Any]:
    """The loss and each state's norm along a job's chain, with health: the dashboard's plots."""
    return {"points": json_safe(look.chain_series(repo, project, job))}


def verify(repo: Repository, info: SnapshotInfo, deep: bool) -> dict[str, Any]:
    """Check one snapshot: its manifest, its chain link, its body and its chunks (present;
    ``deep``: re-read and re-hashed). A check is a read, open to any key: deep checks run one
    at a time on the server (each reads a whole snapshot), and one asked for while another runs
    is refused with 429, not queued (a waiting request would hold a server thread). The answer
    says what was checked (``checked``)."""
    if deep and not _ONE_DEEP_CHECK.acquire(blocking=False):
        raise ApiError(429, "busy", "the server is re-hashing another snapshot (one deep check "
                       "at a time); try again when it finishes")
    try:
        if deep:
            failpoint("server.verify.deep")  # tests: a long deep check
        report = verify_job(repo, info.project, info.job, deep=deep, only=info.id)
    finally:
        if deep:
            _ONE_DEEP_CHECK.release()
    pruned = info.status != "committed" or report.pruned > 0
    return {"id": info.id, "ok": report.ok, "deep": deep, "pruned": pruned,
            "chunks_checked": report.chunks_checked,
            "checked": _checked(report.chunks_checked, deep, pruned),
            "problems": [{"key": p.key, "reason": p.reason} for p in report.problems or []]}


def _checked(chunks: int, deep: bool, pruned: bool) -> str:
    """What a check of one snapshot covered, in words (the dashboard shows it)."""
    if pruned:
        return "the manifest and its parent link; the body and its chunks were pruned"
    if deep:
        return (f"the manifest, its parent link, the body and {counted(chunks, 'chunk')}, "
                "re-read and re-hashed")
    return (f"the manifest, its parent link and the body (re-hashed); {counted(chunks, 'chunk')} "
            "present, not re-read (deep=true re-hashes them)")
