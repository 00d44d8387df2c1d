"""Retention: which snapshots of a job to keep, and pruning the rest.

Rules (by step number, compared as integers: 9900 < 10000):

* ``keep_last=N`` keeps the N snapshots with the highest steps;
* ``keep_every=K`` keeps every snapshot whose step is a multiple of K;
* the newest committed snapshot (by commit time) and any ``protect``ed ID are always kept.

Pruning deletes in reverse write order: the catalog row is marked "pruned", then the body is
deleted. The manifest stays (a few hundred bytes), so the chain of IDs remains verifiable; the
chunks are freed by :func:`ciuic.gc.collect`.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import manifest as mf
from .errors import ConfigurationError
from .info import SnapshotInfo
from .repo import Repository


def plan(snapshots: list[SnapshotInfo], keep_last: int | None, keep_every: int | None,
         protect: Iterable[str] = ()) -> tuple[list[SnapshotInfo], list[SnapshotInfo]]:
    """(keep, prune) for a job's committed snapshots."""
    if keep_last is not None and keep_last < 1:
        raise ConfigurationError(f"keep_last must be at least 1, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ConfigurationError(f"keep_every must be at least 1, got {keep_every}")
    if not snapshots or (keep_last is None and keep_every is None):
        return list(snapshots), []
    keep_ids = set(protect)
    newest = max(snapshots, key=lambda s: (s.created, s.step))
    keep_ids.add(newest.id)
    by_step = sorted(snapshots, key=lambda s: (s.step, s.created), reverse=True)
    if keep_last is not None:
        keep_ids.update(s.id for s in by_step[:keep_last])
    if keep_every is not None:
        keep_ids.update(s.id for s in snapshots if s.step % keep_every == 0)
    keep = [s for s in snapshots if s.id in keep_ids]
    prune = [s for s in snapshots if s.id not in keep_ids]
    return keep, prune


def prune(repo: Repository, project: str, job: str, keep_last: int | None,
          keep_every: int | None, protect: Iterable[str] = (), dry_run: bool = False
          ) -> list[SnapshotInfo]:
    """Apply the rules to a job; returns the snapshots pruned (or that would be)."""
    _, doomed = plan(repo.catalog.snapshots(project, job), keep_last, keep_every, protect)
    if dry_run:
        return doomed
    for s in doomed:
        repo.catalog.set_status(s.id, "pruned")  # reverse order: index first, then data
        repo.store.delete(mf.body_key(project, job, s.body))
    return doomed
