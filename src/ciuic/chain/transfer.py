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

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

from ciuic.chain.read import body_keys, body_states, check_chunk_blob, chunk_refs
from ciuic.chain.repo import Repository, commit_order, list_manifests
from ciuic.errors import (
    CorruptObject,
    IntegrityError,
    ObjectNotFound,
    SnapshotNotFound,
    UnreadableObject,
)
from ciuic.format import layout
from ciuic.format import manifest as mf
from ciuic.format.descriptor import ChunkRef
from ciuic.store import Store

_THREADS = 8

#: ``progress(phase, objects_done, objects_total, bytes_done)``
Progress = Callable[[str, int, int, int], None]


@dataclass
class CopyStats:
    snapshots: int = 0  # new at the destination, with their bodies
    #: pruned ones (their bodies gone) whose manifests went, to keep the chain whole
    pruned: int = 0
    sent: int = 0
    sent_bytes: int = 0
    present: int = 0
    skipped_damaged: int = 0

    def add(self, other: CopyStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def find_job(repo: Repository, text: str) -> tuple[str, str]:
    """``PROJECT/JOB`` or a unique bare ``JOB`` among the jobs in ``repo``."""
    jobs = repo.jobs()
    if "/" in text:
        project, job = text.split("/", 1)
        wanted = (layout.check_name("project", project), layout.check_name("job", job))
        if wanted not in jobs:
            raise SnapshotNotFound(f"no job {text} in {repo.name}; it has: "
                                   f"{', '.join(f'{p}/{j}' for p, j in jobs) or 'no jobs'}")
        return wanted
    matches = [pj for pj in jobs if pj[1] == text]
    if len(matches) != 1:
        what = "no job" if not matches else "several jobs"
        raise SnapshotNotFound(f"{what} named {text!r} in {repo.name}; write PROJECT/JOB "
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
        except (UnreadableObject, ObjectNotFound):
            stats.skipped_damaged += 1  # `ciuic verify` names it; never propagated
    # A manifest at the destination means its objects arrived before it (the write order), so
    # snapshots the destination already has are not looked at again.
    have = {k.snapshot_id for k in list_manifests(dst, project, job)}
    order = [sid for sid in commit_order(manifests) if sid not in have]
    stats.present += len(manifests) - len(order)
    chunks: dict[str, ChunkRef] = {}
    bodies: list[str] = []
    for sid in order:
        m = manifests[sid]
        try:
            states = body_states(src, m)
        except UnreadableObject:
            stats.pruned += 1  # pruned (or its body lost): the manifest alone keeps the chain
            continue
        chunks.update(chunk_refs(states))
        bodies.extend(body_keys(m, states))

    packs: dict[str, list[ChunkRef]] = {}  # pack key -> the referenced pieces it holds
    for ref in chunks.values():
        if ref.pack is not None:
            packs.setdefault(layout.pack_key(ref.pack), []).append(ref)

    def check_chunk(key: str, blob: bytes) -> None:
        if key in packs:  # every referenced piece in it, each against its own name
            view = memoryview(blob)
            for ref in packs[key]:
                piece = view[ref.offset:ref.offset + ref.stored]
                if len(piece) != ref.stored:
                    raise CorruptObject(layout.chunk_key(ref.digest), f"its pack {key} holds "
                                        f"{len(blob)} bytes, not the {ref.offset + ref.stored}"
                                        " its place needs (truncated?)")
                try:
                    check_chunk_blob(src, layout.chunk_key(ref.digest), piece, ref.digest,
                                     ref.nbytes)
                except CorruptObject as e:  # the object being copied is the pack
                    raise CorruptObject(key, f"its piece {e.key} at byte {ref.offset}: "
                                             f"{e.reason}") from e
            return
        d = layout.digest_of_key(key)
        check_chunk_blob(src, key, blob, d, chunks[d].nbytes)

    with ThreadPoolExecutor(_THREADS, thread_name_prefix="ciuic-copy") as pool:  # caller's
        extras = ([layout.PASSPHRASE_SALT] if src.store.has(layout.PASSPHRASE_SALT)
                  else [])
        _send(src, dst, extras, None, pool, verify, stats, progress, "keys", create=True)
        plain = [layout.chunk_key(d) for d, ref in chunks.items() if ref.pack is None]
        _send(src, dst, plain + sorted(packs), check_chunk, pool, verify, stats, progress,
              "chunks")
        dst.sync()
        _send(src, dst, bodies, None, pool, verify, stats, progress, "bodies")
        dst.sync()
        keys = [layout.manifest_key(project, job, sid) for sid in order]
        # Manifests one at a time, parents first: the destination's chain grows in order.
        for key in keys:
            _send(src, dst, [key], None, None, verify, stats, None, "manifests", create=True)
        if progress:
            progress("manifests", len(keys), len(keys), stats.sent_bytes)
    stats.snapshots = len(order) - stats.pruned
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
