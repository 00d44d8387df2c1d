"""Multi-rank snapshots: capture, the two-phase commit, and the resharded restore.

Capture (every rank, training thread): the model and optimizer go through DCP's own state-dict
API (``torch.distributed.checkpoint.state_dict.get_state_dict``): parameter names without
``module.`` prefixes, optimizer state keyed by parameter name, and DTensors for sharded state
(FSDP2, tensor parallel). These are the **global states**. RNG and every extra (data position,
scheduler, user objects) are **per-rank states**.

Commit (every rank, background thread, on ciuic's own ``data`` gloo group):

1. *plan*: every rank sends the metas of its global tensors; every rank computes the same owners
   (:func:`ciuic.shards.plan`: replicas written once, the writing spread across ranks);
2. *prepare*: every rank writes the chunks of the pieces it owns and of its per-rank states,
   syncs them (durable), and sends its descriptors to the coordinator (rank 0);
3. *commit*: only if every rank prepared, the coordinator assembles one body (global states with
   sharded descriptors, ``ranks``: every rank's per-rank states, ``dist``: the layout), writes it
   and creates the manifest (the commit point), then tells every rank the outcome.

A rank that fails reports its error in step 2; a rank that dies fails the collective. Either
way nothing is committed, and every rank raises a :class:`~ciuic.errors.RankError` naming the
ranks that failed (counted and logged by the manager; training goes on).

Restore (every rank): the coordinator picks the candidates and every rank tries the same one;
each rank builds its *target* state dicts with ``get_state_dict`` (so a DTensor target tells
which box of each global tensor this rank needs), reads exactly those boxes
(:func:`ciuic.boxread.read_box`, any world size), checks everything, and only when every rank
succeeded are the values loaded (``set_state_dict``). Per-rank states come from rank
``r % N`` of the N ranks that saved (docs/architecture.md, "Multi-rank").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from . import canonical
from . import manifest as mf
from .capture import (
    _mismatch_message,
    _normalize,
    capture,
    check_loadable,
    load_object,
    set_rng_state,
)
from .crypto import ObjectCodec
from .digest import digest
from .dist import Collective
from .engine.compression import CompressionPolicy
from .errors import CaptureError, ConfigurationError, RankError, StateMismatch
from .faults import failpoint
from .gc import InflightSave
from .lease import Lease
from .reader import _POOL_WORKERS, load_trees
from .repo import Repository
from .shards import Meta, assemble, meta_of, piece_key, plan
from .store import Store
from .tree import Leaf, decode, dtensor_shard, dtype_name, encode, flat_tensors, join, walk_leaves
from .writer import Captured, ChunkCache, commit_snapshot, write_leaves

log = logging.getLogger("ciuic")
GLOBAL = ("model", "optimizer")
LAYOUT = "dcp-fqn"  # model and optimizer as get_state_dict names them


@dataclass
class DistCaptured(Captured):
    """A multi-rank capture: ``global_leaves`` belong to the model/optimizer states."""

    global_leaves: list[Leaf] = field(default_factory=list)
    rank_names: list[str] = field(default_factory=list)
    #: set when this rank failed before the commit protocol (capture, staging): the rank still
    #: takes part, reporting the error, so every rank fails the snapshot together
    error: str | None = None
    #: paths of replicated tensors any holder may write (parameters and optimizer state, equal
    #: on every rank by construction); other replicas (buffers such as BatchNorm statistics,
    #: which DDP only re-broadcasts at the next forward) are written by the lowest rank
    spread: set[str] = field(default_factory=set)
    #: what the plan is told of this rank's global leaves (:func:`plan_metas`)
    metas: list[Meta] | None = None
    #: the layout of this rank's global leaves (:func:`layout_signature`)
    signature: tuple[int, list[Meta]] | None = None
    #: piece keys of global leaves left unstaged (their values are the live tensors): the
    #: previous snapshot with the same layout on this rank had other ranks write them
    unstaged: set[str] = field(default_factory=set)
    #: set by :func:`write_dist`: the piece keys this rank wrote under the plan
    owned: set[str] = field(default_factory=set)

    def to_stage(self) -> list[Leaf]:
        """The leaves to copy into staging buffers: all but the unstaged replicas."""
        if not self.unstaged:
            return self.leaves
        skip = {id(leaf) for leaf in self.global_leaves if leaf_key(leaf) in self.unstaged}
        return [leaf for leaf in self.leaves if id(leaf) not in skip]


def leaf_key(leaf: Leaf) -> str:
    """The plan's key of a global leaf (its path, plus the box's offsets for a shard)."""
    return piece_key(leaf.path, leaf.shard[1] if leaf.shard else None)


def plan_metas(captured: DistCaptured) -> list[Meta]:
    """What this rank tells the plan about its global leaves (computed once per capture)."""
    if captured.metas is None:
        captured.metas = [meta_of(leaf) | {"spread": leaf.path in captured.spread}
                          for leaf in captured.global_leaves]
    return captured.metas


def layout_signature(captured: DistCaptured, world_size: int) -> tuple[int, list[Meta]]:
    """What the plan sees of this rank (its global leaves' metas) and the world size: while
    every rank's stays equal (``==``), the plan assigns the same owners. Compared as it is, not
    digested: this runs in the stall, and for 3000 leaves the canonical JSON and its digest cost
    12 ms more than building the metas."""
    return world_size, plan_metas(captured)


def predicted_owned(captured: DistCaptured, rank: int, world_size: int) -> set[str] | None:
    """The pieces this rank will write, predicted without asking the others, when every global
    leaf is a plain tensor (DDP, replicated modules): every rank then holds the same layout
    (the plan refuses anything else), so the plan is this rank's metas times the world size.
    None for sharded layouts (which rank holds which box is not known locally)."""
    if any(leaf.shard is not None for leaf in captured.global_leaves):
        return None
    owners = plan([plan_metas(captured)] * world_size)
    return {key for key, owner in owners.items() if owner == rank}


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def state_dicts(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """The model's and optimizer's state dicts as DCP names them (either may be None).

    An optimizer without state yet is recorded as its hyperparameters only: DCP would first run
    a zero step to create the state, and a snapshot must not change the training.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return (get_model_state_dict(model) if model is not None else None), None
    if model is None:
        raise ConfigurationError("a multi-rank snapshot names optimizer state by parameter "
                                 "name: pass the model along with the optimizer")
    if not optimizer.state:
        return get_model_state_dict(model), {"state": {},
                                             "param_groups": _hyperparameters(optimizer)}
    return get_state_dict(model, optimizer)


def capture_dist(model: Any, optimizer: Any, extras: Mapping[str, Any]) -> DistCaptured:
    """Capture (references, no copies): global states through DCP, per-rank states as usual."""
    own = capture(None, None, extras)
    msd, osd = state_dicts(model, optimizer)
    leaves: list[Leaf] = []
    states: dict[str, Any] = {}
    spread: set[str] = set()
    if msd is not None:
        states["model"] = encode(msd, "model", leaves)
        params = {_normalize(n) for n, _ in model.named_parameters()} if isinstance(
            model, torch.nn.Module) else set()
        spread = {join("model", k) for k in msd if _normalize(k) in params}
    if osd is not None:
        states["optimizer"] = encode(osd, "optimizer", leaves)
        spread |= {leaf.path for leaf in leaves if leaf.path.startswith("optimizer/")}
    return DistCaptured(states={**states, **own.states}, leaves=leaves + own.leaves,
                        metrics=own.metrics, global_leaves=leaves, rank_names=list(own.states),
                        spread=spread)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def write_dist(coll: Collective, repo: Repository, project: str, job: str, step: int,
               parent: str, captured: DistCaptured, cache: ChunkCache, *,
               lease: Lease | None, codec: ObjectCodec,
               compression: CompressionPolicy, seq: int = 0) -> tuple[mf.Manifest, str, int]:
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
        # 2. prepare: our pieces and our per-rank states, durable
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
            _, new, _ = write_leaves(repo, owned + own, cache, codec, compression)
            failpoint("chunks.sync")
            store.sync()
            failpoint("dist.prepared")
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
                              coll.world_size, lease, codec)
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
            lease: Lease | None, codec: ObjectCodec) -> dict[str, Any]:
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
                                 distributed=True)
    except Exception as e:
        return {"failures": {"0": _error(e)}}
    return {"failures": {}, "sid": sid, "manifest": m.encode().decode()}


# -- restore ---------------------------------------------------------------------------------

def is_distributed(states: Mapping[str, Any]) -> bool:
    """Whether a body's states are a multi-rank snapshot's."""
    return "dist" in states and "ranks" in states


@dataclass
class Prepared:
    """A restore read and checked on this rank, not yet applied."""

    apply: Callable[[], None]
    values: dict[str, Any]  # per-rank values not loaded into an object (restored_values)


def prepare(repo: Repository, trees: dict[str, Any], model: Any, optimizer: Any,
            extras: Mapping[str, Any], rank: int, world_size: int) -> Prepared:
    """Read this rank's part of a multi-rank snapshot into fresh memory and check it against
    the live objects. Nothing live changes until ``apply()``."""
    saved_world = int(trees["dist"]["world_size"])
    parts = trees["ranks"]
    if not isinstance(parts, list) or len(parts) != saved_world:
        raise StateMismatch(f"the snapshot lists {len(parts)} rank parts for a world of "
                            f"{saved_world}")
    part = parts[rank % saved_world]
    if saved_world != world_size and rank == 0:
        log.warning("the snapshot was taken on %d rank(s), this job runs %d: model and "
                    "optimizer are resharded; per-rank state (RNG, data position, extras) of "
                    "rank r comes from saved rank r %% %d", saved_world, world_size,
                    saved_world)
    missing = [n for n in extras if n not in part]
    if missing:
        raise StateMismatch(f"the snapshot has no state for {missing} (it has: "
                            f"{', '.join(sorted(part)) or 'nothing'}); pass only objects that "
                            "were saved")
    for name, obj in extras.items():
        check_loadable(name, obj)
    saved_opt = trees.get("optimizer")
    opt_empty = isinstance(saved_opt, dict) and saved_opt.get("state") == {}
    targets: dict[str, Any] = {}
    if model is not None:
        if "model" not in trees:
            raise StateMismatch("the snapshot holds no model state")
        if optimizer is not None and "optimizer" not in trees:
            raise StateMismatch("the snapshot holds no optimizer state")
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer is None or opt_empty:
            targets["model"] = get_model_state_dict(model)
        else:  # creates a fresh optimizer's state (a zero step at lr 0), to learn its shapes
            targets["model"], targets["optimizer"] = get_state_dict(model, optimizer)
    elif optimizer is not None:
        raise ConfigurationError("restoring an optimizer from a multi-rank snapshot needs its "
                                 "model too (optimizer state is named by parameter names)")
    loaded = _read_targets(repo, trees, targets)
    own = load_trees(repo, part)
    hyper: list[dict[str, Any]] | None = None
    if opt_empty and optimizer is not None:
        assert isinstance(saved_opt, dict)
        hyper = load_trees(repo, {"optimizer": {"param_groups": saved_opt["param_groups"]}})[
            "optimizer"]["param_groups"]
        assert hyper is not None
        if len(hyper) != len(optimizer.param_groups):
            raise StateMismatch(f"the snapshot's optimizer has {len(hyper)} parameter groups, "
                                f"this one has {len(optimizer.param_groups)}")

    def apply() -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        for name, obj in extras.items():  # first: they may still reject their state
            load_object(name, obj, own[name])
        if model is not None:
            log.info("Loading model state...")
            if "optimizer" in loaded:
                log.info("Loading optimizer state...")
                set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                               optim_state_dict=loaded["optimizer"])
            else:
                set_model_state_dict(model, loaded["model"])
        if hyper is not None:
            for group, saved in zip(optimizer.param_groups, hyper, strict=True):
                group.update(saved)
        if "rng" in own:
            set_rng_state(own["rng"])

    values = {k: v for k, v in own.items() if k != "rng" and k not in extras}
    return Prepared(apply, values)


def _read_targets(repo: Repository, trees: dict[str, Any], targets: dict[str, Any]
                  ) -> dict[str, Any]:
    """For each target state dict, the saved values, every tensor read as the box this rank's
    target holds (a DTensor's local shard, else the whole tensor), as new tensors shaped and
    placed like the target's."""
    from .boxread import read_box

    live: dict[str, torch.Tensor] = {}
    for name, sd in targets.items():
        flat_tensors(sd, name, live)
    saved = {p: d for name in targets for p, kind, d in walk_leaves(trees[name], name)
             if kind == "tensor"}
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    changed = []
    for path in sorted(set(live) & set(saved)):
        t, d = live[path], saved[path]
        if dtype_name(t.dtype) != d.get("dtype") or list(t.shape) != d.get("shape"):
            changed.append(f"{path}: snapshot {d.get('dtype')} {d.get('shape')}, live "
                           f"{dtype_name(t.dtype)} {list(t.shape)}")
    if missing or unexpected or changed:
        raise StateMismatch(_mismatch_message("model and optimizer", missing, unexpected,
                                              changed))
    boxes: dict[str, torch.Tensor] = {}
    with ThreadPoolExecutor(_POOL_WORKERS, thread_name_prefix="ciuic-read") as pool, \
            ThreadPoolExecutor(4, thread_name_prefix="ciuic-box") as tensors:
        def one(path: str) -> torch.Tensor:
            t = live[path]
            shard = dtensor_shard(t, path)  # this rank's box of a DTensor; else the whole
            if shard is None:
                return read_box(repo, path, saved[path], None, None, pool)
            local = list(t.to_local().shape)  # type: ignore[attr-defined]
            return read_box(repo, path, saved[path], shard[1], local, pool)

        futures = {p: tensors.submit(one, p) for p in sorted(live)}
        for p, fut in futures.items():
            boxes[p] = fut.result()

    def load_leaf(path: str, kind: str, desc: dict[str, Any]) -> Any:
        if kind != "tensor":
            raise StateMismatch(f"{path}: the snapshot holds a NumPy value where the live "
                                "state has none")
        return _placed(boxes[path], live[path])

    return {name: decode(trees[name], name, load_leaf) for name in targets}


def _placed(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` (this rank's box, on the CPU) as a tensor like ``like``: a DTensor on the same
    mesh and placements, or a plain tensor on the same device."""
    if type(like).__name__ == "DTensor":
        cls: Any = type(like)
        local = value.to(like.to_local().device)  # type: ignore[attr-defined]
        return cls.from_local(local, like.device_mesh,  # type: ignore[attr-defined, no-any-return]
                              like.placements, run_check=False,  # type: ignore[attr-defined]
                              shape=like.shape, stride=like.stride())
    return value.to(like.device)


def check_shared_store(coll: Collective, store: Store, run_id: str) -> None:
    """Every rank must see the objects the others write (one shared filesystem, or S3): rank 0
    writes a probe object that every rank then looks for. Raises on every rank otherwise."""
    key = f"probes/{run_id}.json"
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
