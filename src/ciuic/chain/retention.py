"""Retention: which snapshots of a job to keep, and pruning the rest.

Rules (by step number, compared as integers: 9900 < 10000):

* ``keep_last=N`` keeps the N snapshots with the highest steps of each lineage (snapshots that
  share a root: a restart without ``restore()`` starts a new lineage);
* ``keep_every=K`` keeps every snapshot whose step is a multiple of K;
* the newest committed snapshot (by commit order), the newest one judged healthy (the one to go
  back to after a loss explosion) and any ``protect``ed ID are always kept.

Pruning deletes in reverse write order: the catalog row is marked "pruned", then the body is
deleted. The manifest stays (a few hundred bytes), so the chain of IDs remains verifiable; the
chunks are freed by :func:`ciuic.gc.collect`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ciuic.errors import ConfigurationError
from ciuic.faults import failpoint
from ciuic.format import layout
from ciuic.format.info import SnapshotInfo

if TYPE_CHECKING:  # not at run time: ``ciuic log`` groups lineages without SQLAlchemy
    from ciuic.chain.repo import Repository


def lineages(snapshots: list[SnapshotInfo], parents: dict[str, str]
             ) -> dict[str, list[SnapshotInfo]]:
    """Group snapshots by the root of their chain (``parents``: every known ID -> parent ID)."""
    groups: dict[str, list[SnapshotInfo]] = {}
    for s in snapshots:
        root, seen = s.id, set()
        while parents.get(root) and parents[root] in parents and root not in seen:
            seen.add(root)
            root = parents[root]
        groups.setdefault(root, []).append(s)
    return groups


def plan(snapshots: list[SnapshotInfo], keep_last: int | None, keep_every: int | None,
         protect: Iterable[str] = (), parents: dict[str, str] | None = None
         ) -> tuple[list[SnapshotInfo], list[SnapshotInfo]]:
    """(keep, prune) for a job's committed snapshots.

    The rules apply to each lineage (snapshots sharing a root) separately, so a run that started
    a new lineage is not pruned away by an older lineage's higher steps.
    """
    if keep_last is not None and keep_last < 1:
        raise ConfigurationError(f"keep_last must be at least 1, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ConfigurationError(f"keep_every must be at least 1, got {keep_every}")
    if not snapshots or (keep_last is None and keep_every is None):
        return list(snapshots), []
    keep_ids = set(protect)
    newest = max(snapshots, key=lambda s: (s.seq, s.created, s.step))
    keep_ids.add(newest.id)
    healthy = [s for s in snapshots if s.healthy]
    if healthy:
        keep_ids.add(max(healthy, key=lambda s: (s.seq, s.created, s.step)).id)
    groups = lineages(snapshots, parents if parents is not None else
                      {s.id: s.parent for s in snapshots})
    for group in groups.values():
        by_step = sorted(group, key=lambda s: (s.step, s.seq), reverse=True)
        if keep_last is not None:
            keep_ids.update(s.id for s in by_step[:keep_last])
        if keep_every is not None:
            keep_ids.update(s.id for s in group if s.step % keep_every == 0)
    keep = [s for s in snapshots if s.id in keep_ids]
    prune = [s for s in snapshots if s.id not in keep_ids]
    return keep, prune


def prune(repo: Repository, project: str, job: str, keep_last: int | None,
          keep_every: int | None, protect: Iterable[str] = (), dry_run: bool = False
          ) -> list[SnapshotInfo]:
    """Apply the rules to a job; returns the snapshots pruned (or that would be)."""
    every = repo.catalog.snapshots(project, job, status=None)
    parents = {s.id: s.parent for s in every}
    committed = [s for s in every if s.status == "committed"]
    _, doomed = plan(committed, keep_last, keep_every, protect, parents)
    if dry_run:
        return doomed
    for s in doomed:
        prune_one(repo, s)
    return doomed


def prune_one(repo: Repository, snapshot: SnapshotInfo) -> None:
    """Prune one snapshot: its body goes (its manifest stays, as a link of the chain); the
    chunks only it used go at the next gc. When the body cannot be deleted (a store this user
    may not change), the snapshot is listed as it was again and the error raised: the catalog
    never says pruned of a snapshot whose body is still there."""
    key = layout.body_key(snapshot.project, snapshot.job, snapshot.body)
    repo.catalog.set_status(snapshot.id, "pruned")  # reverse order: index first, then data
    try:
        failpoint("body.delete")
        repo.store.delete(key)
    except BaseException:
        with contextlib.suppress(Exception):  # unsure whether it went: listed pruned, as gc
            if repo.store.has(key):  # would find it
                repo.catalog.set_status(snapshot.id, snapshot.status)
        raise
