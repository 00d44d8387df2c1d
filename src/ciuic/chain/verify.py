"""Verifying a job's chain end to end (``ciuic verify``).

For every manifest in the store (the store is the truth, not the catalog): its bytes hash to its
ID and parse; its parent is another manifest of the job, with a step not above its own; a
committed snapshot's body exists and hashes to the manifest's digest; every chunk the body
references exists (``deep``: is re-read and re-hashed). Each chunk is checked once per run and
every snapshot that uses a damaged chunk is reported. A parent whose damaged manifest ``ciuic gc
--quarantine`` moved aside is counted (``quarantined``), not reported again.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from ciuic.chain.read import (
    READ_THREADS,
    Parts,
    body_keys,
    body_states,
    check_chunk_blob,
    chunk_refs,
    verify_chunks,
)
from ciuic.chain.repo import Repository
from ciuic.errors import IntegrityError, MissingKey, ObjectNotFound, UnreadableObject
from ciuic.format import layout
from ciuic.format import manifest as mf
from ciuic.format.digest import digest


@dataclass(frozen=True)
class Problem:
    snapshot: str  # snapshot ID ("" when not tied to one)
    step: int | None
    key: str
    reason: str
    #: the ID of the key an object is sealed with, when that key is not configured (the object
    #: may be intact; ``ciuic verify`` reports such objects once per key)
    key_id: str | None = None

    @classmethod
    def of(cls, snapshot: str, step: int | None, key: str, e: Exception) -> Problem:
        """The problem an error found (its own key and reason where it names an object)."""
        if isinstance(e, UnreadableObject):
            return cls(snapshot, step, e.key, e.reason,
                       e.key_id if isinstance(e, MissingKey) else None)
        return cls(snapshot, step, key, str(e))


@dataclass
class VerifyReport:
    snapshots: int = 0
    pruned: int = 0
    chunks_checked: int = 0
    #: the job's manifests moved to quarantine/ (damaged: `ciuic gc --quarantine`)
    quarantined: int = 0
    problems: list[Problem] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_job(repo: Repository, project: str, job: str, *, deep: bool = False,
               only: str | None = None,
               progress: Callable[[str, int, int], None] | None = None,
               _chunk_cache: dict[str, Problem | None] | None = None) -> VerifyReport:
    """Verify a job's chain (or just snapshot ``only`` and its ancestry links). ``progress``:
    called with (phase, done, count), phase "snapshots", then (deep) "unreferenced chunks"."""
    report = VerifyReport(problems=[])
    problems = report.problems
    assert problems is not None
    ids = repo.manifest_ids(project, job)
    aside = {k.snapshot_id for k in map(
        layout.parse_manifest, _quarantined(repo, layout.manifests_prefix(project, job)))
        if k is not None}
    report.quarantined = len(aside)
    manifests: dict[str, mf.Manifest] = {}
    for sid in ids:
        key = layout.manifest_key(project, job, sid)
        try:
            manifests[sid] = repo.read_manifest(project, job, sid)
        except (UnreadableObject, ObjectNotFound) as e:
            problems.append(Problem.of(sid, None, key, e))
    if only is not None and only not in ids:
        problems.append(Problem(only, None, layout.manifest_key(project, job, only),
                                "missing: the catalog lists it but the store has no manifest"))
        return report
    targets = [only] if only is not None else list(manifests)
    cache = _chunk_cache if _chunk_cache is not None else {}
    checked_bodies: set[str] = set()  # the bodies and their parts read whole
    tables: dict[str, IntegrityError | None] = {}  # box tables read: their error, if any
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ciuic-verify") as pool:
        for n, sid in enumerate(targets):
            if progress:
                progress("snapshots", n, len(targets))
            m = manifests.get(sid)
            if m is None:
                continue
            if m.parent:
                parent = manifests.get(m.parent)
                if parent is None and m.parent not in aside:
                    problems.append(Problem(sid, m.step,
                                            layout.manifest_key(project, job, m.parent),
                                            "the parent snapshot's manifest is missing or "
                                            "damaged: the chain is broken"))
                elif parent is not None and parent.step > m.step:
                    problems.append(Problem(sid, m.step, layout.manifest_key(project, job, sid),
                                            f"step {m.step} follows parent step {parent.step}: "
                                            "the chain is out of order"))
            bkey = layout.body_key(project, job, m.body)
            if not repo.store.has(bkey):
                report.pruned += 1
                continue
            report.snapshots += 1
            try:
                states = body_states(repo, m)
            except IntegrityError as e:
                problems.append(Problem.of(sid, m.step, bkey, e))
                continue
            keys = body_keys(m, states)
            parts = Parts.of(repo, m, states)
            if parts is not None and parts.table is not None:
                if keys[-1] not in tables:  # read once: the snapshots of a layout share it
                    try:
                        parts.boxes()  # checked against its name
                        tables[keys[-1]] = None
                    except IntegrityError as damaged:
                        tables[keys[-1]] = damaged
                found = tables[keys[-1]]
                if found is not None:
                    problems.append(Problem.of(sid, m.step, keys[-1], found))
            checked_bodies.update(keys)
            refs = chunk_refs(states)
            fresh = {d: size for d, size in refs.items() if d not in cache}
            bad = {layout.name_of(key): Problem("", None, key, "missing") if e is None
                   else Problem.of("", None, key, e)
                   for key, e in verify_chunks(repo, fresh, deep, pool)}
            for d in fresh:
                cache[d] = bad.get(d)
            report.chunks_checked += len(fresh)
            for d in refs:
                hit = cache.get(d)
                if hit is not None:
                    problems.append(replace(hit, snapshot=sid, step=m.step))
    if deep and only is None:
        checked_bodies.update(layout.body_key(project, job, m.body) for m in manifests.values())
        problems.extend(_unreferenced_bodies(repo, project, job, checked_bodies))
        problems.extend(_unreferenced_chunks(repo, cache, progress))
        report.chunks_checked = sum(1 for _ in cache)
    # one problem per (snapshot, key)
    report.problems = list(dict.fromkeys(problems))
    if progress:
        progress("snapshots", len(targets), len(targets))
    return report


def _quarantined(repo: Repository, prefix: str) -> list[str]:
    """The keys (as they were) of the objects under ``prefix`` moved to quarantine/."""
    return [k[len(layout.QUARANTINE):] for k in repo.store.list(layout.quarantine_key(prefix))]


def _unreferenced_chunks(repo: Repository, cache: dict[str, Problem | None],
                         progress: Callable[[str, int, int], None] | None = None
                         ) -> list[Problem]:
    """Deep verification re-hashes every chunk object, also those no readable snapshot names
    (their snapshot's manifest or body may be the damaged part)."""
    problems = []
    keys = list(repo.store.list(layout.CHUNKS))
    for n, key in enumerate(keys):
        if progress:
            progress("unreferenced chunks", n, len(keys))
        d = layout.chunk_digest(key)
        if d is None:
            problems.append(Problem("", None, key, "not a chunk (a stray object under chunks/)"))
            continue
        if d in cache:
            continue
        try:
            check_chunk_blob(repo, key, repo.store.get(key), d, None)
            cache[d] = None
        except IntegrityError as e:
            found = cache[d] = Problem.of("", None, key, e)
            problems.append(replace(found, reason=found.reason + " (no readable snapshot names "
                                    "this chunk)"))
    if progress:
        progress("unreferenced chunks", len(keys), len(keys))
    return problems


def _unreferenced_bodies(repo: Repository, project: str, job: str,
                         checked: set[str]) -> list[Problem]:
    problems = []
    for key in repo.store.list(layout.bodies_prefix(project, job)):
        body = layout.parse_body(key)
        if key in checked or body is None:
            continue
        name = body[2]
        try:
            plain, name_key = repo.open_meta(key, repo.store.get(key))
            actual = digest(plain, key=name_key)
        except IntegrityError as e:
            problems.append(Problem.of("", None, key, e))
            continue
        if actual != name:
            problems.append(Problem("", None, key, f"content hash {actual[:16]}... does not "
                                    "match its name (no readable snapshot names this body)"))
    return problems
