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
from ciuic.chain.health import HealthTracker
from ciuic.chain.lease import Lease
from ciuic.chain.repo import Repository
from ciuic.chain.writer import ChunkCache, commit_snapshot, write_leaves
from ciuic.distributed.collective import Collective
from ciuic.distributed.plan import GLOBAL, LAYOUT, DistCaptured, leaf_key, plan_metas
from ciuic.engine.compression import CompressionPolicy
from ciuic.errors import CaptureError, ConfigurationError, RankError
from ciuic.faults import failpoint
from ciuic.format import canonical, layout
from ciuic.format import manifest as mf
from ciuic.format.crypto import ObjectCodec
from ciuic.format.digest import digest
from ciuic.format.shards import assemble, plan
from ciuic.store import Store

log = logging.getLogger("ciuic")


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def write_dist(coll: Collective, repo: Repository, project: str, job: str, step: int,
               parent: str, captured: DistCaptured, cache: ChunkCache, *,
               lease: Lease | None, codec: ObjectCodec,
               compression: CompressionPolicy, seq: int = 0,
               health: HealthTracker | None = None) -> tuple[mf.Manifest, str, int]:
    """The two-phase commit of one multi-rank snapshot (every rank calls it, same order).
    Returns the manifest, the snapshot ID and the bytes of new chunks this rank wrote."""
    what = f"snapshot at step {step}"
    # 1. plan (every rank comes here for every agreed snapshot, even one that already failed
    # locally: it then reports its error instead of its metas)
    mine: dict[str, Any] = {"error": captured.error, "step": step, "seq": seq}
    if captured.error is None:
        try:
            names = [n for n in GLOBAL if n in captured.states]
            shape = canonical.dumps({n: captured.states[n] for n in names})
            mine |= {"metas": plan_metas(captured),
                     "skeleton": digest(shape)}
        except Exception as e:
            mine["error"] = _error(e)
    everyone = coll.all_gather(mine, data=True)
    failures = {r: str(x["error"]) for r, x in enumerate(everyone) if x["error"]}
    if failures:
        raise RankError(what, failures)
    if len({(x["seq"], x["step"]) for x in everyone}) > 1:  # a safety net: never mix steps
        raise RankError(f"{what}: the ranks are out of step", {
            r: f"at snapshot #{x['seq']}, step {x['step']}" for r, x in enumerate(everyone)})
    odd = [r for r, x in enumerate(everyone) if x["skeleton"] != everyone[0]["skeleton"]]
    if odd:
        raise CaptureError(
            f"the model/optimizer state of rank(s) {odd} differs from rank 0's in structure or "
            "in a non-tensor value (parameter names, optimizer settings such as lr): ciuic "
            "supports replicated (DDP) and DTensor-sharded (FSDP2, tensor parallel) state; "
            "save state that only some ranks hold (pipeline stages) as a per-rank extra")
    owners = plan([x["metas"] for x in everyone])

    store = repo.store
    inflight = InflightSave(store)  # gc keeps our chunks until the commit is decided
    entered = False
    try:
        # 2. write: our pieces and our per-rank states, durable
        report: dict[str, Any]
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
                    f"this rank must write {len(lost)} replicated tensor(s) it did not copy "
                    f"(e.g. {lost[0]}): the plan changed since the previous snapshot although "
                    "this rank's layout did not. This snapshot fails on every rank; the next "
                    "one copies everything")
            own = [leaf for leaf in captured.leaves if id(leaf) not in glob]
            _, new, _ = write_leaves(repo, owned + own, cache, codec, compression,
                                     stats=health is not None)
            failpoint("chunks.sync")
            store.sync()
            failpoint("dist.written")
            report = {
                "error": None, "new": new, "tensors": len(own),
                "own_bytes": sum(leaf.nbytes for leaf in own),
                "written": [{"path": leaf.path, "offsets": leaf.shard[1] if leaf.shard else None,
                             "desc": leaf.descriptor} for leaf in owned],
                "states": {n: captured.states[n] for n in captured.rank_names},
            }
        except Exception as e:
            report = {"error": _error(e)}
        reports = coll.gather(report, data=True)
        # 3. commit (coordinator), then everyone learns the outcome
        outcome: dict[str, Any] | None = None
        if reports is not None:
            outcome = _commit(repo, project, job, step, parent, captured, reports,
                              coll.world_size, lease, codec, health)
        outcome = coll.broadcast(outcome, data=True)
    finally:
        if entered:
            inflight.__exit__(None, None, None)
    assert outcome is not None
    if outcome["failures"]:
        raise RankError(what, {int(r): str(msg) for r, msg in outcome["failures"].items()})
    m = mf.Manifest.decode(str(outcome["manifest"]).encode())
    return m, str(outcome["sid"]), new


def _commit(repo: Repository, project: str, job: str, step: int, parent: str,
            captured: DistCaptured, reports: list[dict[str, Any]], world_size: int,
            lease: Lease | None, codec: ObjectCodec,
            health: HealthTracker | None = None) -> dict[str, Any]:
    failures = {str(r): str(rep["error"]) for r, rep in enumerate(reports) if rep["error"]}
    if failures:
        return {"failures": failures}
    try:
        assemble(captured.global_leaves, [w for rep in reports for w in rep["written"]])
        states: dict[str, Any] = {n: captured.states[n] for n in GLOBAL if n in captured.states}
        states["ranks"] = [rep["states"] for rep in reports]
        states["dist"] = {"layout": LAYOUT, "world_size": world_size}
        total = sum(int(leaf.descriptor["nbytes"]) for leaf in captured.global_leaves)
        total += sum(int(rep["own_bytes"]) for rep in reports)
        tensors = len(captured.global_leaves) + sum(int(rep["tensors"]) for rep in reports)
        m, sid = commit_snapshot(repo, project, job, step, parent, states, captured.metrics,
                                 tensors, total, sum(int(rep["new"]) for rep in reports),
                                 world_size=world_size, lease=lease, codec=codec,
                                 distributed=True, health=health)
    except Exception as e:
        return {"failures": {"0": _error(e)}}
    return {"failures": {}, "sid": sid, "manifest": m.encode().decode()}


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
            f"rank(s) {blind} cannot see the objects rank 0 writes to {store.url}: every rank "
            "of a multi-rank job must use one shared store (a shared filesystem path, or S3), "
            "not a directory local to each node")
