"""The two-phase commit of a multi-rank snapshot.

Every rank, on its background thread and ciuic's own ``data`` gloo group:

1. *plan*: every rank sends the digest of its global tensors' layout; where a layout changed,
   every rank computes the same owners alone, by rule, or where the ranks' tensors disagree
   from every rank's metas (:mod:`ciuic.distributed.plan`: replicas written once, the writing
   spread across ranks);
2. *write*: every rank writes the chunks of the pieces it owns and of its per-rank states, and
   its *part* of the body (the descriptors of its shards, its per-rank states:
   :mod:`ciuic.format.parts`), syncs them (durable), and sends the coordinator (rank 0) its
   part's digest and the descriptors of the replicated tensors it wrote; two all-reduces give
   each sharded tensor's whole statistics and the elements written of it;
3. *commit*: only if every rank wrote, the coordinator writes the body's *index* (global states
   whose sharded descriptors say ``"split"``, ``dist``: the layout and every rank's part) and
   creates the manifest (the commit point), then tells every rank the outcome. What it receives
   and writes grows with the tensors plus the ranks, not their product.

A rank that fails reports its error in step 2; a rank that dies fails the collective. Either
way nothing is committed, and every rank raises a :class:`~ciuic.errors.RankError` naming the
ranks that failed (counted and logged by the manager; training goes on).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

import torch

from ciuic.chain.gc import InflightSave
from ciuic.chain.writer import SnapshotContent, SnapshotWrite, commit_snapshot, write_leaves
from ciuic.distributed.collective import Collective
from ciuic.distributed.messages import Outcome, Plan, Plans, Report
from ciuic.distributed.plan import (
    GLOBAL,
    LAYOUT,
    DistCaptured,
    leaf_key,
    plan_metas,
    ruled_plan,
)
from ciuic.errors import CaptureError, ConfigurationError, RankError
from ciuic.faults import failpoint
from ciuic.format import canonical, layout
from ciuic.format import manifest as mf
from ciuic.format.boxes import BoxTable
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.digest import digest
from ciuic.format.parts import BodyPart
from ciuic.format.shards import Written, assemble, plan, shard_of
from ciuic.format.stats import Stats
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
            # in a canonical order: a restored optimizer lists its state in another order,
            # and the plan does not depend on it
            ordered = sorted(metas, key=lambda x: (x["path"], x["offsets"] or []))
            mine = Plan(step, seq, skeleton=digest(shape),
                        layout=digest(canonical.dumps(ordered)), known=plans.joint)
        except Exception as e:
            mine = Plan(step, seq, error=_error(e))
    everyone = [Plan.from_json(x) for x in coll.all_gather(mine.to_json(), data=True)]
    failures = {r: x.error for r, x in enumerate(everyone) if x.error}
    if any(error.startswith(f"{CaptureError.__name__}: ") for error in failures.values()):
        # a rank's state could not be captured: it fails the same way at every snapshot
        raise CaptureError(str(RankError(what, failures)))
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
        # a layout changed, or a rank has no plan of these layouts: made anew
        _replan(coll, captured, plans, joint, metas)

    store = repo.store
    inflight = InflightSave(store)  # gc keeps our chunks until the commit is decided
    entered = False
    owned: list[Leaf] = []
    try:
        # 2. write: our pieces, our per-rank states and our part of the body, durable
        report: Report
        new = 0
        try:
            inflight.__enter__()
            entered = True
            cache.sync(inflight.epoch)
            glob = {id(leaf) for leaf in captured.global_leaves}
            owned = [leaf for leaf in captured.global_leaves
                     if plans.owner(leaf_key(leaf)) == coll.rank]
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
            part = _write_part(w, coll.rank, captured, owned, plans)
            failpoint("chunks.sync")
            store.sync()
            failpoint("dist.written")
            report = Report(
                new=new, tensors=len(own), own_bytes=sum(leaf.nbytes for leaf in own),
                written=[Written(leaf.path, None, _described(leaf)) for leaf in owned
                         if leaf.shard is None],
                part=part, stats=_rank_stats(coll.rank, own),
                held=_held(captured.global_leaves))
        except Exception as e:
            report = Report(error=_error(e))
            owned = []
        whole = _whole(coll, captured.global_leaves, owned)
        reports = coll.gather(report.to_json(), data=True)
        # 3. commit (coordinator), then everyone learns the outcome
        decided: dict[str, Any] | None = None
        if reports is not None:
            decided = _commit(w, captured, [Report.from_json(r) for r in reports],
                              coll.world_size, whole, plans, inflight.epoch).to_json()
        outcome = Outcome.from_json(coll.broadcast(decided, data=True))
    finally:
        if entered:
            inflight.__exit__(None, None, None)
    if outcome.failures:
        raise RankError(what, outcome.failures)
    m = mf.Manifest.decode(outcome.manifest.encode())
    return m, outcome.sid, new


def _replan(coll: Collective, captured: DistCaptured, plans: Plans, joint: str,
            metas: list[Any]) -> None:
    """Make the plan anew (every rank, together): by rule where every rank's tensors agree
    (:func:`~ciuic.distributed.plan.ruled_plan`: one digest a rank exchanged, O(world size)
    bytes), else from every rank's metas (O(tensors x world size) bytes: the plan then says
    where the ranks disagree)."""
    mine = ruled_plan(captured, coll.rank, coll.world_size)
    votes = coll.all_gather(None if mine is None else mine[0], data=True)
    if mine is not None and all(v == votes[0] for v in votes):
        owners = mine[1]
    else:
        owners = plan(list(coll.all_gather(metas, data=True)))
        plans.exchanged += 1
    # every piece's owner: an adopted plan's default owner no longer applies
    plans.joint, plans.owners, plans.default = joint, owners, None
    plans.made += 1


def _described(leaf: Leaf) -> TensorDescriptor:
    if leaf.described is None:  # a programming error: write_leaves describes every leaf
        raise AssertionError(f"{leaf.path} was written but not described")
    return leaf.described


def _write_part(w: SnapshotWrite, rank: int, captured: DistCaptured, owned: list[Leaf],
                plans: Plans) -> tuple[str, int]:
    """Write this rank's part of the body (docs/format.md, body format 3): the descriptors of
    the shards it wrote, its per-rank states, the ranks that wrote the boxes it holds but did
    not write, and the plan's owner of each piece it holds but did not write. Returns its
    digest and bytes."""
    shards: dict[str, list[dict[str, Any]]] = {}
    for leaf in owned:
        if leaf.shard is not None:
            shards.setdefault(leaf.path, []).append(
                shard_of(leaf.shard[1], _described(leaf)).to_json())
    others = {key: owner for key, owner in ((leaf_key(leaf), plans.owner(leaf_key(leaf)))
                                           for leaf in captured.global_leaves) if owner != rank}
    reads = sorted({others[leaf_key(leaf)] for leaf in captured.global_leaves
                    if leaf.shard is not None and leaf_key(leaf) in others})
    part = BodyPart(rank, shards, {n: captured.states[n] for n in captured.rank_names},
                    tuple(reads), others)
    data = part.encode()
    name = w.codec.name(data)
    key = layout.body_key(w.project, w.job, name)
    failpoint("part.put")
    w.repo.store.put(key, w.codec.meta(key, data))
    return name, len(data)


def _held(leaves: list[Leaf]) -> list[list[Any]]:
    """[layout class, offsets, shape] of each box this rank holds, once per class."""
    out: dict[str, list[Any]] = {}
    for leaf in leaves:
        if leaf.shard is not None and leaf.sharding is not None and leaf.sharding not in out:
            out[leaf.sharding] = [leaf.sharding, list(leaf.shard[1]), list(leaf.value.shape)]
    return [out[k] for k in sorted(out)]


def _write_boxes(w: SnapshotWrite, leaves: list[Leaf], reports: list[Report]
                 ) -> tuple[str, int] | None:
    """Write the box table (format/boxes.py) of the boxes every rank holds, per layout class
    of the coordinator's sharded tensors; its digest and bytes (None: no class is known)."""
    paths: dict[str, list[str]] = {}
    for leaf in leaves:
        if leaf.shard is not None and leaf.sharding is not None:
            paths.setdefault(leaf.sharding, []).append(leaf.path)
    table = BoxTable.build(paths, ((r, ((str(c), list(o), list(s)) for c, o, s in rep.held))
                                   for r, rep in enumerate(reports)))
    if not table.classes:
        return None
    data = table.encode()
    name = w.codec.name(data)
    key = layout.body_key(w.project, w.job, name)
    w.repo.store.put(key, w.codec.meta(key, data))
    return name, len(data)


def _rank_stats(rank: int, own: list[Leaf]) -> list[list[Any]]:
    """[path, elements, stats] of this rank's per-rank float tensors, named as the health
    verdict names them (``ranks/<rank>/<state>/...``)."""
    out: list[list[Any]] = []
    for leaf in own:
        d = _described(leaf)
        if d.stats is not None:
            out.append([f"ranks/{rank}/{leaf.path}", math.prod(d.shape), dict(d.stats)])
    return out


def _whole(coll: Collective, leaves: list[Leaf], owned: list[Leaf]
           ) -> dict[str, tuple[int, Stats | None]]:
    """Each sharded tensor's elements written by every rank together and its statistics
    combined, by path: two all-reduces of a row per sharded tensor (every rank calls it, even
    after a local failure), so the coordinator never gathers the shards' descriptors."""
    paths = sorted({leaf.path for leaf in leaves if leaf.shard is not None})
    if not paths:
        return {}
    row = {p: i for i, p in enumerate(paths)}
    sums = torch.zeros(len(paths), 6, dtype=torch.float64)  # volume, counted, nan, inf, sum, sq
    tops = torch.full((len(paths), 2), -math.inf, dtype=torch.float64)  # max, -min
    for leaf in owned:
        if leaf.shard is None:
            continue
        d, i = _described(leaf), row[leaf.path]
        n = math.prod(d.shape)
        sums[i, 0] += n
        s = Stats.from_json(d.stats, n) if d.stats is not None else None
        if s is None:
            continue
        sums[i, 1:] += torch.tensor([n, s.nan, s.inf, s.total, s.sumsq], dtype=torch.float64)
        if s.lo is not None and s.hi is not None:
            tops[i] = torch.maximum(tops[i], torch.tensor([s.hi, -s.lo], dtype=torch.float64))
    sums = coll.all_reduce(sums, "sum", data=True)
    tops = coll.all_reduce(tops, "max", data=True)
    out: dict[str, tuple[int, Stats | None]] = {}
    for p, i in row.items():
        volume, counted_, nan, inf, total, sumsq = (float(x) for x in sums[i])
        hi, neg_lo = (float(x) for x in tops[i])
        stats = None
        if counted_ == volume and volume > 0:
            finite = math.isfinite(hi)
            stats = Stats(int(counted_), int(nan), int(inf), total, sumsq,
                          -neg_lo if finite else None, hi if finite else None)
        out[p] = (int(volume), stats)
    return out


def _commit(w: SnapshotWrite, captured: DistCaptured, reports: list[Report],
            world_size: int, whole: dict[str, tuple[int, Stats | None]], plans: Plans,
            epoch: int) -> Outcome:
    failures = {r: rep.error for r, rep in enumerate(reports) if rep.error}
    if failures:
        return Outcome(failures)
    try:
        assemble(captured.global_leaves, [piece for rep in reports for piece in rep.written],
                 whole)
        states: dict[str, Any] = {n: captured.states[n] for n in GLOBAL if n in captured.states}
        states["dist"] = {"layout": LAYOUT, "world_size": world_size, "plan": plans.joint,
                          "parts": [list(rep.part) for rep in reports]}
        # the table is the same bytes while every rank's layout is (the layouts' digest
        # covers each shard's box and class): written once, unless a gc ran since
        if plans.table is not None and plans.table[:2] == (plans.joint, epoch):
            boxes = plans.table[2]
        else:
            boxes = _write_boxes(w, captured.global_leaves, reports)
            plans.table = (plans.joint, epoch, boxes)
        if boxes is not None:
            states["dist"]["boxes"] = list(boxes)
        total = sum(_described(leaf).nbytes for leaf in captured.global_leaves)
        total += sum(rep.own_bytes for rep in reports)
        tensors = len(captured.global_leaves) + sum(rep.tensors for rep in reports)
        stats = {path: s for rep in reports for path, n, obj in rep.stats
                 if (s := Stats.from_json(obj, int(n))) is not None}
        m, sid = commit_snapshot(w, SnapshotContent(
            states, captured.metrics, tensors, total, sum(rep.new for rep in reports),
            world_size=world_size, distributed=True, split=True, stats=stats))
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
