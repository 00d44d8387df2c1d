"""Multi-rank restore: each rank reads exactly the boxes of the global tensors its target state
dicts hold, and its own per-rank states, checks everything, and applies nothing until told to.

Every rank builds its *target* state dicts with ``get_state_dict`` (so a DTensor target tells
which box of each global tensor this rank needs), reads those boxes
(:func:`ciuic.restore.boxread.read_box`, any world size) into fresh memory and checks them
against the live objects: :func:`prepare`. The manager applies the result only when every rank
prepared (``Prepared.apply``). A state only rank 0 saved is every rank's (read from rank 0's
part). Per-rank states come from rank ``r % N`` of the N ranks that
saved (docs/architecture.md, "Multi-rank").
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ciuic.chain.read import READ_THREADS, Parts
from ciuic.chain.repo import Repository
from ciuic.distributed.plan import both_state_dicts, model_state_dict
from ciuic.errors import ConfigurationError, CorruptObject, StateMismatch
from ciuic.format.boxes import overlap
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.parts import BodyPart, shards_by_path, with_shards
from ciuic.format.tree import (
    decode,
    dtensor_shard,
    dtype_name,
    flat_tensors,
    walk_leaves,
)
from ciuic.restore.match import Prepared, check_loadable, load_object, mismatch_message
from ciuic.restore.reader import load_trees
from ciuic.restore.sources import Resident, pack_runs
from ciuic.state.capture import set_rng_state
from ciuic.words import counted

log = logging.getLogger("ciuic")


def is_distributed(states: Mapping[str, Any]) -> bool:
    """Whether a body's states are a multi-rank snapshot's (format 2, or a split body's
    index: format 3)."""
    dist = states.get("dist")
    return isinstance(dist, dict) and ("ranks" in states or "parts" in dist)


def prepare(repo: Repository, trees: dict[str, Any], model: Any, optimizer: Any,
            extras: Mapping[str, Any], rank: int, world_size: int,
            resident: Resident | None = None, parts: Parts | None = None) -> Prepared:
    """Read this rank's part of a multi-rank snapshot into fresh memory and check it against
    the live objects. Nothing live changes until ``apply()``. ``resident``: chunks in host
    memory (``ciuic run``), taken from there where they match their digests. ``parts``: the
    parts of a split body (``trees`` is its index), read as they are needed."""
    saved_world = int(trees["dist"]["world_size"])
    listed = len(parts) if parts is not None else len(trees.get("ranks") or [])
    if listed != saved_world:
        raise StateMismatch(f"the snapshot lists {listed} rank parts for a world of "
                            f"{saved_world}")
    if parts is not None:  # (both at once: on an object store each is a round trip)
        mine, zero = parts.some([rank % saved_world, 0])
        part, first = mine.state, zero.state
    else:
        part, first = trees["ranks"][rank % saved_world], trees["ranks"][0]
    if saved_world != world_size and rank == 0:
        log.warning("the snapshot was taken on %s, this job runs %d: model and "
                    "optimizer are resharded; per-rank state (RNG, data position, extras) of "
                    "rank r comes from saved rank r %% %d", counted(saved_world, "rank"),
                    world_size, saved_world)
    # a state that rank 0 alone saved (what a framework hands rank 0 only: its checkpoint
    # dict, DeepSpeed's client_state) is every rank's: each reads it from rank 0's part
    part = {**{k: v for k, v in first.items() if k not in part}, **part}
    missing = [n for n in extras if n not in part]
    if missing:
        raise StateMismatch(f"the snapshot has no state for {', '.join(missing)} (it has: "
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
        if optimizer is None or opt_empty:
            targets["model"] = model_state_dict(model)
        else:  # creates a fresh optimizer's state (a zero step at lr 0), to learn its shapes
            targets["model"], targets["optimizer"] = both_state_dicts(model, optimizer)
    elif optimizer is not None:
        raise ConfigurationError("restoring an optimizer from a multi-rank snapshot needs its "
                                 "model too (optimizer state is named by parameter names)")
    shards = None if parts is None else _Near(parts, rank, saved_world, world_size)
    loaded = _read_targets(repo, trees, targets, resident, shards)
    own = load_trees(repo, part, resident=resident)
    hyper: list[dict[str, Any]] | None = None
    if opt_empty and optimizer is not None:
        assert isinstance(saved_opt, dict)
        hyper = load_trees(repo, {"optimizer": {"param_groups": saved_opt["param_groups"]}},
                           resident=resident)[
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


def _read_targets(repo: Repository, trees: dict[str, Any], targets: dict[str, Any],
                  resident: Resident | None, near: _Near | None = None) -> dict[str, Any]:
    """For each target state dict, the saved values, every tensor read as the box this rank's
    target holds (a DTensor's local shard, else the whole tensor), as new tensors shaped and
    placed like the target's. ``near``: a split body's parts (its sharded descriptors'
    shards are there)."""
    from ciuic.restore.boxread import box_refs, read_box

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
        raise StateMismatch(mismatch_message("model and optimizer", missing, unexpected,
                                              changed))
    # this rank's box of each, (offsets, shape); (None, None): the whole tensor. A DTensor
    # says it at some cost (~1 ms), so once.
    wanted: dict[str, tuple[list[int] | None, list[int] | None]] = {
        p: _wanted(live[p], p) or (None, None) for p in live}
    split = {p: d for p, d in saved.items() if d.get("split") is True}
    if split:
        if near is None:
            raise StateMismatch("the snapshot's body is in parts, but none was given to read")
        saved.update(near.shards(split, {p: (wanted[p][0] or [0] * live[p].dim(),
                                             wanted[p][1] or list(live[p].shape))
                                         for p in split}))
    boxes: dict[str, torch.Tensor] = {}
    descs = {p: TensorDescriptor.from_json(saved[p], p) for p in live}
    runs = pack_runs(repo, resident, (r for p in sorted(live)  # in the order read below
                                      for r in box_refs(p, descs[p], *wanted[p])))
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ciuic-read") as pool, \
            ThreadPoolExecutor(4, thread_name_prefix="ciuic-box") as tensors, \
            runs if runs is not None else contextlib.nullcontext():
        def one(path: str) -> torch.Tensor:
            return read_box(repo, path, descs[path], *wanted[path], pool, resident, runs)

        futures = {p: tensors.submit(one, p) for p in sorted(live)}
        for p, fut in futures.items():
            boxes[p] = fut.result()

    def load_leaf(path: str, kind: str, desc: dict[str, Any]) -> Any:
        if kind != "tensor":
            raise StateMismatch(f"{path}: the snapshot holds a NumPy value where the live "
                                "state has none")
        return _placed(boxes[path], live[path])

    return {name: decode(trees[name], name, load_leaf) for name in targets}


def _wanted(t: torch.Tensor, path: str) -> tuple[list[int], list[int]] | None:
    """The box of its global tensor a live DTensor holds (offsets, shape); None for a whole
    tensor."""
    shard = dtensor_shard(t, path)
    if shard is None:
        return None
    return list(shard[1]), list(t.to_local().shape)  # type: ignore[attr-defined]


class _Near:
    """Where a rank finds the shards of a split body's tensors: on the layout that saved it,
    in its own part (and the parts it names: boxes another rank wrote once for both); on
    another layout, in the parts the box table names for its boxes (format/boxes.py); else in
    every part (a snapshot without a table, or a box those parts do not cover)."""

    def __init__(self, parts: Parts, rank: int, saved_world: int, world_size: int) -> None:
        self.parts, self.rank = parts, rank
        self.same = saved_world == world_size
        self.saved_world = saved_world

    def shards(self, split: dict[str, dict[str, Any]],
               boxes: dict[str, tuple[list[int], list[int]]]) -> dict[str, dict[str, Any]]:
        """The split descriptors with the shards this rank's boxes need."""
        def filled(parts: list[BodyPart]) -> dict[str, dict[str, Any]]:
            found = shards_by_path(parts)
            return {p: with_shards(d, found.get(p, [])) for p, d in split.items()}

        if self.same:
            mine = self.parts.get(self.rank % self.saved_world)
            out = filled([mine, *(self.parts.get(r) for r in mine.reads)])
            if all(_covers(out[p]["shards"], *boxes[p]) for p in out):
                return out
            log.info("rank %d's part of the body does not hold all its boxes: reading every "
                     "rank's part", self.rank)
        else:
            try:
                table = self.parts.boxes()
            except CorruptObject as e:  # every part still holds the answer
                log.warning("%s: reading every rank's part instead", e)
                table = None
            ranks = table.ranks_for({p: boxes[p] for p in split}) if table is not None else None
            if ranks is not None:
                out = filled(self.parts.some(sorted(ranks)))
                if all(_covers(out[p]["shards"], *boxes[p]) for p in out):
                    return out
                log.warning("the parts the box table names for rank %d's boxes do not hold "
                            "them all: reading every rank's part", self.rank)
        return filled(self.parts.all())


def _covers(shards: list[dict[str, Any]], off: list[int], shape: list[int]) -> bool:
    """Whether the shards hold every element of the box (they never overlap)."""
    held = 0
    for s in shards:
        o, n = s.get("offsets"), s.get("shape")
        if not (isinstance(o, list) and isinstance(n, list) and len(o) == len(n) == len(off)):
            return False
        meet = overlap(o, n, off, shape)
        if meet is not None:
            held += math.prod(meet[1])
    return held == math.prod(shape)


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
