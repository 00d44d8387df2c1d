"""The two-phase commit of a multi-rank snapshot.

Every rank, on its background thread and ciuic's own ``data`` gloo group:

1. *plan*: every rank sends the metas of its global tensors; every rank computes the same owners
   (:mod:`ciuic.distributed.plan`: replicas written once, the writing spread across ranks);
2. *write*: every rank writes the chunks of the pieces it owns and of its per-rank states,
   syncs them (durable), and sends its descriptors to the coordinator (rank 0);
3. *commit*: only if every rank wrote, the coordinator assembles one body (global states with
   sharded descriptors, ``ranks``: every rank's per-rank states, ``dist``: the layout), writes it
   and creates the manifest (the commit point), then tells every rank the outcome.

A rank that fails reports its error in step 2; a rank that dies fails the collective. Either
way nothing is committed, and every rank raises a :class:`~ciuic.errors.RankError` naming the
ranks that failed (counted and logged by the manager; training goes on).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from ciuic.chain.gc import InflightSave
from ciuic.chain.writer import SnapshotContent, SnapshotWrite, commit_snapshot, write_leaves
from ciuic.distributed.collective import Collective
from ciuic.distributed.messages import Outcome, Plan, Plans, Report
from ciuic.distributed.plan import GLOBAL, LAYOUT, DistCaptured, leaf_key, plan_metas
from ciuic.errors import CaptureError, ConfigurationError, RankError
from ciuic.faults import failpoint
from ciuic.format import canonical, layout
from ciuic.format import manifest as mf
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.digest import digest
from ciuic.format.shards import Written, assemble, plan
from ciuic.format.tree import Leaf
from ciuic.store import Store
from ciuic.words import counted, listed

log = logging.getLogger("ciuic")


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def write_dist(coll: Collective, w: SnapshotWrite, captured: DistCaptured, seq: int = 0,
               plans: Plans | None = None) -> tuple[mf.Manifest, str, int]:
    """The two-phase commit of one multi-rank snapshot (every rank calls it, same order).
    Returns the manifest, the snapshot ID and the bytes of new chunks this rank wrote.
    ``plans``: this rank's cache of the last plan (None: the plan is made every time)."""
    step, repo, cache = w.step, w.repo, w.cache
    what = f"snapshot at step {step}"
    plans = plans if plans is not None else Plans()
    # 1. plan (every rank comes here for every agreed snapshot, even one that already failed
    # locally: it then reports its error instead of its layout)
    mine = Plan(step, seq, error=captured.error)
    metas: list[Any] = []
    if captured.error is None:
        try:
            names = [n for n in GLOBAL if n in captured.states]
            shape = canonical.dumps({n: captured.states[n] for n in names})
            metas = plan_metas(captured)
            mine = Plan(step, seq, skeleton=digest(shape), layout=digest(canonical.dumps(metas)),
                        known=plans.joint)
        except Exception as e:
            mine = Plan(step, seq, error=_error(e))
    everyone = [Plan.from_json(x) for x in coll.all_gather(mine.to_json(), data=True)]
    failures = {r: x.error for r, x in enumerate(everyone) if x.error}
    if failures:
        raise RankError(what, failures)
    if len({(x.seq, x.step) for x in everyone}) > 1:  # a safety net: never mix steps
        raise RankError(f"{what}: the ranks are out of step", {
            r: f"at snapshot #{x.seq}, step {x.step}" for r, x in enumerate(everyone)})
    odd = [r for r, x in enumerate(everyone) if x.skeleton != everyone[0].skeleton]
    if odd:
        raise CaptureError(
            f"the model/optimizer state of {listed(odd, 'rank')} differs from rank 0's in "
            "structure or in a non-tensor value (parameter names, optimizer settings such as "
            "lr): ciuic supports replicated (DDP) and DTensor-sharded (FSDP2, tensor parallel) "
            "state; save state that only some ranks hold (pipeline stages) as a per-rank "
            "extra")
    joint = digest(canonical.dumps([x.layout for x in everyone]))
    if any(x.known != joint for x in everyone):  # (the same answer on every rank)
        # a layout changed, or a rank has no plan of these layouts: made anew, from metas
        gathered = coll.all_gather(metas, data=True)
        plans.joint, plans.owners = joint, plan(list(gathered))
        plans.made += 1
    owners = plans.owners

    store = repo.store
    inflight = InflightSave(store)  # gc keeps our chunks until the commit is decided
    entered = False
    try:
        # 2. write: our pieces and our per-rank states, durable
        report: Report
        new = 0
        try:
            inflight.__enter__()
            entered = True
            cache.sync(inflight.epoch)
            glob = {id(leaf) for leaf in captured.global_leaves}
            owned = [leaf for leaf in captured.global_leaves
                     if owners[leaf_key(leaf)] == coll.rank]
            captured.owned = {leaf_key(leaf) for leaf in owned}
            lost = sorted(captured.owned & captured.unstaged)
            if lost:  # a safety net: only a layout change on another rank can cause it
                raise CaptureError(
                    f"this rank must write {counted(len(lost), 'replicated tensor')} it did "
                    f"not copy (e.g. {lost[0]}): the plan changed since the previous snapshot "
                    "although this rank's layout did not. This snapshot fails on every rank; "
                    "the next one copies everything")
            own = [leaf for leaf in captured.leaves if id(leaf) not in glob]
            new = write_leaves(repo, owned + own, cache, w.codec, w.compression,
                               stats=w.health is not None).new
            captured.written = {leaf.path: _described(leaf) for leaf in owned + own}
            failpoint("chunks.sync")
            store.sync()
            failpoint("dist.written")
            report = Report(
                new=new, tensors=len(own), own_bytes=sum(leaf.nbytes for leaf in own),
                written=[Written(leaf.path, leaf.shard[1] if leaf.shard else None,
                                 _described(leaf)) for leaf in owned],
                states={n: captured.states[n] for n in captured.rank_names})
        except Exception as e:
            report = Report(error=_error(e))
        reports = coll.gather(report.to_json(), data=True)
        # 3. commit (coordinator), then everyone learns the outcome
        decided: dict[str, Any] | None = None
        if reports is not None:
            decided = _commit(w, captured, [Report.from_json(r) for r in reports],
                              coll.world_size).to_json()
        outcome = Outcome.from_json(coll.broadcast(decided, data=True))
    finally:
        if entered:
            inflight.__exit__(None, None, None)
    if outcome.failures:
        raise RankError(what, outcome.failures)
    m = mf.Manifest.decode(outcome.manifest.encode())
    return m, outcome.sid, new


def _described(leaf: Leaf) -> TensorDescriptor:
    if leaf.described is None:  # a programming error: write_leaves describes every leaf
        raise AssertionError(f"{leaf.path} was written but not described")
    return leaf.described


def _commit(w: SnapshotWrite, captured: DistCaptured, reports: list[Report],
            world_size: int) -> Outcome:
    failures = {r: rep.error for r, rep in enumerate(reports) if rep.error}
    if failures:
        return Outcome(failures)
    try:
        assemble(captured.global_leaves, [piece for rep in reports for piece in rep.written])
        states: dict[str, Any] = {n: captured.states[n] for n in GLOBAL if n in captured.states}
        states["ranks"] = [rep.states for rep in reports]
        states["dist"] = {"layout": LAYOUT, "world_size": world_size}
        total = sum(_described(leaf).nbytes for leaf in captured.global_leaves)
        total += sum(rep.own_bytes for rep in reports)
        tensors = len(captured.global_leaves) + sum(rep.tensors for rep in reports)
        m, sid = commit_snapshot(w, SnapshotContent(
            states, captured.metrics, tensors, total, sum(rep.new for rep in reports),
            world_size=world_size, distributed=True))
    except Exception as e:
        return Outcome({0: _error(e)})
    return Outcome(sid=sid, manifest=m.encode().decode())


# -- restore ---------------------------------------------------------------------------------

def check_shared_store(coll: Collective, store: Store, run_id: str) -> None:
    """Every rank must see the objects the others write (one shared filesystem, or S3): rank 0
    writes a probe object that every rank then looks for. Raises on every rank otherwise."""
    key = layout.probe_key(run_id)
    error = None
    if coll.coordinator:
        try:
            store.put(key, b"{}")
        except Exception as e:
            error = _error(e)
    coll.agree("writing the store probe", error)
    try:
        here: list[Any] = [store.has(key), None]
    except Exception as e:
        here = [False, _error(e)]
    seen = coll.all_gather(here)
    if coll.coordinator:
        with contextlib.suppress(Exception):
            store.delete(key)
    failed = {r: str(err) for r, (_, err) in enumerate(seen) if err}
    if failed:
        raise RankError("looking for the store probe", failed)
    blind = [r for r, (ok, _) in enumerate(seen) if not ok]
    if blind:
        raise ConfigurationError(
            f"{listed(blind, 'rank')} cannot see the objects rank 0 writes to {store.url}: "
            "every rank of a multi-rank job must use one shared store (a shared filesystem "
            "path, or S3), not a directory local to each node")
