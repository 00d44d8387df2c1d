"""Copying a job's chain between stores: ``ciuic push``, ``pull`` and ``copy``, and the mirror's
catch-up.

Only the objects the destination lacks are sent; a snapshot whose manifest the destination
already has is complete there (manifests are written last) and is skipped without a look. Every
object is checked against its name before it leaves (a damaged source object is never
propagated) and, with ``verify``, read back after it arrives and compared. The write order of
docs/format.md holds at the destination too: chunks, then bodies (after one batched sync), then
manifests, parents first, with the manifest's create-if-absent last; a copy interrupted at any
point leaves the destination's chain consistent, and running it again finishes it.

Sealed (encrypted) objects travel as they are; reading which chunks a snapshot references
needs the key, exactly as restoring does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

from . import chunks as ck
from . import manifest as mf
from .crypto import SALT_KEY
from .errors import CorruptObject, IntegrityError, ObjectNotFound, SnapshotNotFound
from .reader import body_states, check_chunk_blob, chunk_refs
from .repo import Repository, commit_order
from .store import Store

_JOB_KEY = re.compile(r"^jobs/([^/]+)/([^/]+)/manifests/[0-9a-f]{64}\.json$")
_THREADS = 8

#: ``progress(phase, objects_done, objects_total, bytes_done)``
Progress = Callable[[str, int, int, int], None]


@dataclass
class CopyStats:
    snapshots: int = 0
    sent: int = 0
    sent_bytes: int = 0
    present: int = 0
    skipped_damaged: int = 0

    def add(self, other: CopyStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def jobs_in(store: Store) -> list[tuple[str, str]]:
    """Every (project, job) with at least one manifest in ``store``."""
    found = {(m.group(1), m.group(2)) for k in store.list("jobs/") if (m := _JOB_KEY.match(k))}
    return sorted(found)


def find_job(store: Store, text: str) -> tuple[str, str]:
    """``PROJECT/JOB`` or a unique bare ``JOB`` among the jobs in ``store``."""
    jobs = jobs_in(store)
    if "/" in text:
        project, job = text.split("/", 1)
        wanted = (mf.check_name("project", project), mf.check_name("job", job))
        if wanted not in jobs:
            raise SnapshotNotFound(f"no job {text} in {store.url}; it has: "
                                   f"{', '.join(f'{p}/{j}' for p, j in jobs) or 'no jobs'}")
        return wanted
    matches = [pj for pj in jobs if pj[1] == text]
    if len(matches) != 1:
        what = "no job" if not matches else "several jobs"
        raise SnapshotNotFound(f"{what} named {text!r} in {store.url}; write PROJECT/JOB "
                               f"(jobs there: {', '.join(f'{p}/{j}' for p, j in jobs) or '-'})")
    return matches[0]


def copy_job(src: Repository, dst: Store, project: str, job: str, *, verify: bool = True,
             progress: Progress | None = None) -> CopyStats:
    """Send ``project/job``'s chain from ``src`` to ``dst``; return what was sent."""
    stats = CopyStats()
    manifests: dict[str, mf.Manifest] = {}
    for sid in src.manifest_ids(project, job):
        try:
            manifests[sid] = src.read_manifest(project, job, sid)
        except (CorruptObject, ObjectNotFound):
            stats.skipped_damaged += 1  # `ciuic verify` names it; never propagated
    # A manifest at the destination means its objects arrived before it (the write order), so
    # snapshots the destination already has are not looked at again.
    have = set(dst.list(mf.job_prefix(project, job) + "manifests/"))
    order = [sid for sid in commit_order(manifests)
             if mf.manifest_key(project, job, sid) not in have]
    stats.present += len(manifests) - len(order)
    chunks: dict[str, int] = {}
    bodies: list[str] = []
    for sid in order:
        m = manifests[sid]
        try:
            chunks.update(chunk_refs(body_states(src, m)))
        except CorruptObject:
            continue  # pruned (or its body lost): the manifest alone keeps the chain
        bodies.append(mf.body_key(project, job, m.body))

    def check_chunk(key: str, blob: bytes) -> None:
        d = key.rsplit("/", 1)[1]
        check_chunk_blob(src, key, blob, d, chunks[d])

    with ThreadPoolExecutor(_THREADS, thread_name_prefix="ciuic-copy") as pool:  # caller's
        extras = [SALT_KEY] if src.store.has(SALT_KEY) else []
        _send(src, dst, extras, None, pool, verify, stats, progress, "keys", create=True)
        _send(src, dst, [ck.chunk_key(d) for d in chunks], check_chunk, pool, verify, stats,
              progress, "chunks")
        dst.sync()
        _send(src, dst, bodies, None, pool, verify, stats, progress, "bodies")
        dst.sync()
        keys = [mf.manifest_key(project, job, sid) for sid in order]
        # Manifests one at a time, parents first: the destination's chain grows in order.
        for key in keys:
            _send(src, dst, [key], None, None, verify, stats, None, "manifests", create=True)
        if progress:
            progress("manifests", len(keys), len(keys), stats.sent_bytes)
    stats.snapshots = len(order)
    return stats


def _send(src: Repository, dst: Store, keys: Iterable[str],
          check: Callable[[str, bytes], None] | None, pool: ThreadPoolExecutor | None,
          verify: bool, stats: CopyStats, progress: Progress | None, phase: str,
          create: bool = False) -> None:
    todo = list(keys)
    run = pool.map if pool is not None else map
    missing = [k for k, present in zip(todo, run(dst.has, todo), strict=True) if not present]
    stats.present += len(todo) - len(missing)
    def one(key: str) -> int:
        blob = src.store.get(key)
        if check is not None:
            check(key, blob)
        if create:
            dst.create(key, blob)
        else:
            dst.put(key, blob, durable=False)
        if verify and dst.get(key) != blob:
            raise IntegrityError(f"{dst.location(key)} differs from the source after the copy; "
                                 "the destination store is damaging data")
        return len(blob)

    if progress:
        progress(phase, 0, len(missing), stats.sent_bytes)
    for done, n in enumerate(run(one, missing), 1):
        stats.sent += 1
        stats.sent_bytes += n
        if progress:
            progress(phase, done, len(missing), stats.sent_bytes)
