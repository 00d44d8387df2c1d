"""Recovery: find the snapshots to try, then for each one *prepare* (check it against the live
objects from its body alone, then read and verify every byte, straight into the live tensors
that can take it: :mod:`ciuic.restore.local`), *agree* (multi-rank: the worst outcome of any
rank, for every rank) and *apply* (load the objects). One path for a single process and for
every rank of a torchrun job; a single process is a world of one.

A damaged snapshot is skipped for the previous one, with a warning; one that does not fit the
live objects stops the restore (an older snapshot would not fit either); if snapshots exist but
none loads, :class:`~ciuic.errors.RestoreError` is raised: recovery never starts from scratch
while snapshots exist.
"""

from __future__ import annotations

import base64
import difflib
import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from ciuic.chain import runs
from ciuic.chain.read import Parts, read_body
from ciuic.chain.repo import list_jobs
from ciuic.distributed.collective import Collective
from ciuic.distributed.load import is_distributed, prepare
from ciuic.distributed.plan import import_ahead
from ciuic.errors import (
    ConfigurationError,
    CorruptObject,
    IntegrityError,
    MissingKey,
    ObjectNotFound,
    RestoreError,
    StateMismatch,
)
from ciuic.format import layout
from ciuic.format.descriptor import ChunkRef, refs_in
from ciuic.format.info import SnapshotInfo
from ciuic.manager.pipeline import Pipeline
from ciuic.manager.session import RunSession
from ciuic.restore.local import prepare_local
from ciuic.restore.match import Prepared
from ciuic.restore.sources import BufferFor, Resident, host_copy, lend_staging, staged_copy
from ciuic.words import counted

log = logging.getLogger("ciuic")
_NUMBERS = re.compile(r"\d+")


@dataclass
class Restored:
    """What a restore loaded: the snapshot, and the values it holds that no object took."""

    info: SnapshotInfo
    values: dict[str, Any]


class Recovery:
    """Restores a job's latest complete snapshot (or a named one) into live objects."""

    def __init__(self, session: RunSession, coll: Collective, pipeline: Pipeline[Any]) -> None:
        self.session = session
        self.coll = coll
        self.repo = session.repo
        #: the write path a restore reads into (its staging buffers, its host-memory copy),
        #: tells of damaged chunks, and tells what the next snapshot follows
        self._pipeline = pipeline
        #: the snapshot whose bytes were last read straight into live tensors (None: none were)
        self.read_into: str | None = None
        #: chunk bytes the last restore read from this node's memory, other nodes' and the
        #: store (summed over the ranks: rank 0's figure is the job's)
        self.read: tuple[int, int, int] = (0, 0, 0)
        #: the plan of the multi-rank snapshot being restored, for this rank (joint layouts'
        #: digest, owners of its pieces other ranks wrote), adopted once it is applied
        self._plan: tuple[str, dict[str, int]] | None = None
        #: the chunks the last restore took from memory
        self.served: list[ChunkRef] = []
        #: the chunks of the snapshot being restored: the writer's, once it is applied
        self._seeds: dict[str, ChunkRef] = {}

    def restore(self, model: Any, optimizer: Any, extras: dict[str, Any],
                snapshot: str | None) -> Restored | None:
        """The model's bytes are read into the pipeline's staging buffers (the next snapshot
        stages into them without allocating); a snapshot ``ciuic run`` holds in host memory is
        read from there, when it is the snapshot being restored (never in place of a newer
        one). The next snapshot follows the one restored."""
        p = self._pipeline
        sup = self.session.supervised
        peers = sup.peers.reader() if sup is not None and sup.peers is not None else None
        host = host_copy(p.tier, p.codec.name_key, peers)
        staged = None
        if host is None and p.config.asynchronous:
            host = staged = staged_copy(p.staging, p.codec.name_key)
        lent = lend_staging(p.staging, model) if p.config.asynchronous else None
        try:
            done = self._restore(model, optimizer, extras, snapshot, lent, host)
        finally:
            self.repo.preload({})  # what rank 0 read for this rank and it did not need
            if peers is not None:
                peers.close()
        if p.tier is not None and host is not None and (done is None
                                                        or done.info.id != host.snapshot):
            p.tier.invalidate()  # the restore read another snapshot into its buffers
        if done is not None and staged is not None:
            p.check_stored(self.served)
        if done is not None:
            info = done.info
            p.continue_from(info, same_job=(info.project, info.job) == (self.session.project,
                                                                         self.session.job))
        return done

    def _restore(self, model: Any, optimizer: Any, extras: dict[str, Any],
                 snapshot: str | None, buffer_for: BufferFor | None,
                 host: Resident | None) -> Restored | None:
        project, job = self.session.project, self.session.job
        self.read_into = None
        if self.coll.enabled:
            import_ahead()  # while rank 0 lists the snapshots and every rank reads the body
        candidates = self.candidates(snapshot)
        if not candidates:
            self._nothing_to_restore()
            return None
        problems: list[str] = []
        for info in candidates:
            log.info("Found snapshot at step %d, timestamp: %sZ", info.step, info.created[:19])
            resident = host.serving(info.id) if host is not None else None
            where = self.repo.location(layout.manifest_key(info.project, info.job, info.id))
            if resident is not None and resident.held():
                log.info("Loading snapshot from host memory (%s hold%s %s %s), every "
                         "chunk checked against its digest; the rest from %s%s",
                         resident.holder, "" if resident.holder.endswith("s") else "s",
                         _size(resident.held()), "of it" if not self.coll.enabled
                         else "on this node", "other nodes' memory or " if resident.peers
                         else "", where)
            elif resident is not None and resident.peers is not None:
                log.info("Loading snapshot from other nodes' memory (this node's holds none of "
                         "it), every chunk checked against its digest; the rest from %s", where)
            else:
                log.info("%s snapshot from %s", "Loading" if "://" not in where
                         else "Downloading", where)
            t0 = time.perf_counter()
            prepared: Prepared | None = None
            outcome, detail = "ok", ""
            try:
                prepared = self.prepare(info, model, optimizer, extras, buffer_for, resident)
            except MissingKey as e:  # not damage: an older snapshot is no answer to it
                outcome, detail = "error", f"{e}; nothing was restored"
            except (IntegrityError, ObjectNotFound) as e:
                outcome, detail = "damaged", str(e)
                if isinstance(e, CorruptObject) and (d := layout.chunk_digest(e.key)):
                    self._pipeline.cache.distrust(d)
                    log.warning("%s will be written again by the next snapshot that holds its "
                                "bytes", e.key)
            except (StateMismatch, ConfigurationError) as e:
                outcome, detail = "mismatch", str(e)
            except Exception as e:
                if not self.coll.enabled:
                    raise
                outcome, detail = "error", f"{type(e).__name__}: {e}"  # every rank stops
            read = (0, 0, 0) if resident is None else (
                resident.from_memory, resident.from_peers, resident.from_store)
            outcome, detail = self.agree(outcome, detail, read)
            if outcome == "mismatch":
                raise StateMismatch(detail + self._partial())
            if outcome == "error":
                raise RestoreError(f"restoring snapshot {info.short_id} failed:\n{detail}"
                                   + self._partial())
            if outcome == "damaged":
                problems.append(f"step {info.step} ({info.short_id}): {detail}")
                if snapshot not in (None, "healthy"):
                    raise RestoreError(f"snapshot {info.short_id} cannot be restored: {detail}")
                log.warning("Snapshot at step %d (%s) is damaged: %s; falling back to the "
                            "previous snapshot", info.step, info.short_id, detail)
                # for `ciuic log`: the snapshot is damaged, and why the next one was restored
                self.session.event("damaged", info.step, f"{info.id}: {detail}")
                continue
            assert prepared is not None
            memory, peer, store = self.read  # every rank's, summed
            if host is not None and self.coll.coordinator and memory + peer + store:
                log.info("Read %s from host memory%s and %s from the store in %.2f s%s",
                         _size(memory), f", {_size(peer)} from other nodes' memory"
                         if host.peers is not None else "", _size(store),
                         time.perf_counter() - t0,
                         f" (all {self.coll.world_size} ranks)" if self.coll.enabled else "")
            prepared.apply()
            self._pipeline.cache.seed(self._seeds)
            self.served = resident.served if resident is not None else []
            if self._plan is not None:
                self._pipeline.adopt_plan(*self._plan)
            return Restored(info, prepared.values)
        raise RestoreError(
            f"job {project}/{job} has {counted(len(candidates), 'snapshot')} but none could be "
            "restored:\n  " + "\n  ".join(problems) + "\nRun `ciuic verify --deep "
            f"{project}/{job}` for details; refusing to start from scratch." + self._partial()
        )

    def _partial(self) -> str:
        """What a failed restore left in the live tensors, when it had read into them."""
        if self.read_into is None:
            return ""
        return (f"\nThe model's and optimizer's tensors were read into (snapshot "
                f"{self.read_into}) and hold part of a snapshot: do not train on them.")

    def _nothing_to_restore(self) -> None:
        """No snapshot of this job: say so, and when the project has other jobs (a typo in
        ``job=`` silently starting from scratch is the costly case), warn with the nearest."""
        project, job = self.session.project, self.session.job
        others: list[str] = []
        if self.coll.coordinator:
            try:
                others = [j for _, j in list_jobs(self.repo.store, project) if j != job]
            except Exception as e:  # the listing is advice only
                log.debug("could not list the jobs of %s: %s", project, e)
        # run-3 beside run-1 and run-2 is a new run of a series, not a typo
        series = _NUMBERS.sub("#", job)
        near = difflib.get_close_matches(
            job, [j for j in others if _NUMBERS.sub("#", j) != series], n=3, cutoff=0.6)
        if not near:  # a new job beside others of other names: nothing looks like a typo
            log.info("No snapshot of %s/%s in %s: starting from scratch", project, job,
                     self.repo.name)
            return
        log.warning("No snapshot of %s/%s in %s: starting from scratch. The project has jobs of "
                    "a similar name (nearest first): %s. If this run should resume one of them, "
                    "stop it and pass job=%r", project, job, self.repo.name, ", ".join(near),
                    near[0])

    def candidates(self, snapshot: str | None) -> list[SnapshotInfo]:
        """The snapshots to try, newest first. Multi-rank: rank 0 decides, every rank follows."""
        found: list[SnapshotInfo] = []
        error = None
        s = self.session
        if self.coll.coordinator:
            try:
                if snapshot == "healthy":  # every healthy one, newest first (damage: the next)
                    self.repo.sync_job(s.project, s.job)
                    found = self.repo.healthy(s.project, s.job)
                elif snapshot is not None:
                    found = [self.repo.resolve(snapshot)]
                else:
                    self.repo.sync_job(s.project, s.job)
                    found = self.repo.catalog.snapshots(s.project, s.job, newest_first=True)
            except Exception as e:
                if not self.coll.enabled:
                    raise
                error = f"{type(e).__name__}: {e}"
            prev = s.previous_run
            if s.interrupted and prev is not None:
                log.info("Detected training interruption %s (%s)", _where(s, found),
                         "no exit was recorded: it may still be running" if
                         runs.may_still_run(prev) else runs.describe_end(prev,
                                                                         s.previous_known))
            log.info("Searching for latest snapshot...")
        if not self.coll.enabled:
            return found
        objects = self._for_every_rank(found[:1])
        self.repo.preload(objects)
        shared = self.coll.broadcast({
            "error": error, "found": [asdict(i) for i in found],
            "objects": {k: base64.b64encode(v).decode("ascii") for k, v in objects.items()}})
        if shared["error"]:
            raise RestoreError(f"rank 0 could not list the snapshots: {shared['error']}")
        if self.coll.coordinator:
            return found
        self.repo.preload({k: base64.b64decode(v) for k, v in shared["objects"].items()})
        return [SnapshotInfo(**info) for info in shared["found"]]  # what rank 0's catalog says

    def _for_every_rank(self, first: list[SnapshotInfo]) -> dict[str, bytes]:
        """Rank 0: the newest snapshot's manifest and body as the store holds them, read once
        for every rank: each rank checks them as it checks a read of its own (their keys name
        their content), and reads the store for what is missing or fails. Without this, every
        rank reads the same two objects at once (at 16,384 ranks, 32,768 GETs of two keys).
        Nothing where they cannot be read: each rank then finds out why itself."""
        if not self.coll.coordinator or not first:
            return {}
        info = first[0]
        keys = [layout.manifest_key(info.project, info.job, info.id)]
        if info.body:
            keys.append(layout.body_key(info.project, info.job, info.body))

        def raw(key: str) -> tuple[str, bytes] | None:
            try:
                return key, self.repo.store.get(key)
            except Exception as e:  # each rank reads it, and reports what it finds
                log.debug("could not read %s for every rank: %s", key, e)
                return None

        with ThreadPoolExecutor(len(keys), thread_name_prefix="ciuic-read") as pool:
            return dict(r for r in pool.map(raw, keys) if r is not None)

    def prepare(self, info: SnapshotInfo, model: Any, optimizer: Any, extras: dict[str, Any],
                buffer_for: BufferFor | None, resident: Resident | None = None) -> Prepared:
        """Check a snapshot against the live objects (a snapshot that does not fit touches
        nothing), then read and verify it (``prepare_local``, or this rank's part of a
        multi-rank snapshot); the result's ``apply()`` loads the objects."""
        self._plan = None
        m, trees = read_body(self.repo, info, parts=False)  # a split body's own part later
        self._seeds = refs_in(trees)
        if is_distributed(trees):
            parts = Parts.of(self.repo, m, trees)
            prepared = prepare(self.repo, trees, model, optimizer, extras, self.coll.rank,
                               self.coll.world_size, resident, parts)
            if parts is not None:
                self._pipeline.stats.restore_parts = (parts.count, len(parts))
                plan = trees["dist"].get("plan")
                if isinstance(plan, str) and len(parts) == self.coll.world_size:
                    self._plan = (plan, parts.get(self.coll.rank).others)
                    self._seeds.update(refs_in(parts.get(self.coll.rank).shards))
            return prepared

        def reading_into() -> None:
            self.read_into = info.short_id

        return prepare_local(self.repo, info, trees, model, optimizer, extras, buffer_for,
                             resident, reading_into)

    def agree(self, outcome: str, detail: str, read: tuple[int, int, int] = (0, 0, 0)
              ) -> tuple[str, str]:
        """Multi-rank: the worst outcome of any rank, for every rank (a mismatch anywhere stops
        every rank; damage anywhere moves every rank to the previous snapshot). ``read``: the
        chunk bytes this rank read from this node's memory, other nodes' and the store, summed
        over the ranks into :attr:`read`."""
        self.read = read
        if not self.coll.enabled:
            return outcome, detail
        everyone = self.coll.all_gather([outcome, detail, *read])
        self.read = (sum(int(x[2]) for x in everyone), sum(int(x[3]) for x in everyone),
                     sum(int(x[4]) for x in everyone))
        log.debug("chunk bytes read by each rank (this node's memory, other nodes', store): "
                  "%s", [tuple(x[2:]) for x in everyone])
        for worst in ("error", "mismatch", "damaged"):
            ranks: dict[str, list[int]] = {}  # one line per distinct message
            for r, (o, d, *_) in enumerate(everyone):
                if o == worst:
                    ranks.setdefault(d, []).append(r)
            if ranks:
                return worst, "\n".join(
                    f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {d}"
                    for d, rs in ranks.items())
        return "ok", ""


def _size(n: int) -> str:
    if n == 0:
        return "0 B"  # none at all, where 0.00 MiB could be a few bytes
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _where(session: RunSession, found: list[SnapshotInfo]) -> str:
    """Where the previous run stopped (``runs.stopped_where``): its last step(), when its end
    record, its progress file on this machine or ``ciuic run`` says; else "after" the later of
    its recorded progress and the latest snapshot (progress reaches the catalog now and then,
    so the run got at least that far)."""
    prev = session.previous_run
    if prev is not None and session.previous_known:
        return runs.stopped_where(prev.last_step, exact=True)
    steps = [x for x in (prev.last_step if prev else None, *(i.step for i in found[:1]))
             if x is not None]
    return runs.stopped_where(max(steps) if steps else None, exact=False)
