"""megatron-core's sharded state dicts in a ciuic snapshot, and back (for
:mod:`ciuic.integrations.megatron`).

megatron-core describes a rank's state with ``sharded_state_dict()``: each ``ShardedTensor``
is a box (``global_offset``, local shape, with ``prepend_axis_num`` leading axes of 1) of a
global tensor named ``key`` of ``global_shape``, and ``replica_id`` says which of the ranks that
hold the same box is its main replica; a ``ShardedObject`` is an opaque value at an offset of a
grid of objects; a ``ShardedTensorFactory`` builds tensors on save and merges them back on load;
a ``LocalNonpersistentObject`` stays with the live process; everything else is the *common*
state (plain values).

On save, Megatron's own preprocessing (``save_preprocess``'s steps: factories applied,
non-persistent values dropped) splits the dict; each rank keeps the **main replicas** only, so
every box of every global tensor is written once across the job, as one entry of the rank's
``tensors`` (key, global shape, offset, box shape, the data), and its main-replica objects as
``objects`` (their values through ciuic's tree and adapters: nothing pickled); the common state
as it is.

On load, the live ``sharded_state_dict`` (built for loading) names every box this rank needs.
Each is read from the snapshot's pieces of that key, across every saved rank: the box this
rank itself wrote comes from its own part (already read and verified by the manager), any other
box through :func:`ciuic.restore.boxread.read_box`, which reads only the chunks that hold it, so
a box of another parallel layout is assembled from the pieces that cover it. Then Megatron's
own load steps (non-persistent values merged, factories' merges applied) give the plain state
dict that ``load_state_dict`` takes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ciuic.chain.read import READ_THREADS
from ciuic.chain.repo import Repository
from ciuic.errors import ConfigurationError, StateMismatch
from ciuic.format.descriptor import Shard, TensorDescriptor
from ciuic.format.shards import check_tiling
from ciuic.format.tree import dtype_name, torch_dtype
from ciuic.restore.boxread import read_box
from ciuic.restore.reader import load_trees

try:
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
        apply_factories,
        apply_factory_merges,
        is_main_replica,
    )
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
    from megatron.core.dist_checkpointing.utils import extract_nonpersistent, extract_sharded_base
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("ciuic.integrations.megatron needs megatron-core: pip install "
                      "'ciuic[megatron]'") from e

Box = tuple[str, tuple[int, ...], tuple[int, ...]]  # key, global offset, box shape


def box_of(t: ShardedTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, box shape) of a ShardedTensor: its local shape behind the prepended
    axes of 1 (``prepend_axis_num``)."""
    if t.flattened_range is not None:
        raise ConfigurationError(
            f"{t.key}: a ShardedTensor with a flattened range (the distributed optimizer's "
            "'fully_sharded_model_space' sharding) is not supported; snapshot the distributed "
            "optimizer with sharding_type='dp_reshardable' (MegatronSnapshots' default)")
    shape = (1,) * t.prepend_axis_num + tuple(int(n) for n in t.local_shape)
    offset = tuple(int(o) for o in t.global_offset)
    if len(shape) != len(t.global_shape) or len(offset) != len(shape):
        raise ConfigurationError(f"{t.key}: box {list(shape)} at {list(offset)} does not fit "
                                 f"the global shape {list(t.global_shape)}")
    return offset, shape


def _walk(tree: Any, visit: Callable[[Any], None]) -> None:
    if isinstance(tree, dict):
        for v in tree.values():
            _walk(v, visit)
    elif isinstance(tree, list):
        for v in tree:
            _walk(v, visit)
    else:
        visit(tree)


def _zero_padding(tree: Any) -> None:
    """The distributed optimizer's ``dp_reshardable`` padding between parameters in a bucket
    (a dict marked ``padding``: ``LocalNonpersistentObject(True)``) holds ``torch.empty``
    tensors, never read back: zeros instead, so that a snapshot holds no stray bytes (stray
    NaNs made the health check call it unhealthy) and unchanged padding deduplicates."""
    if isinstance(tree, dict):
        pad = tree.get("padding")
        if isinstance(pad, LocalNonpersistentObject) and pad.unwrap() is True:
            for v in tree.values():
                if isinstance(v, ShardedTensor) and v.data is not None:
                    v.data = torch.zeros_like(v.data)
            return
        for v in tree.values():
            _zero_padding(v)
    elif isinstance(tree, list):
        for v in tree:
            _zero_padding(v)


def to_snapshot(sharded_state: dict[str, Any]) -> dict[str, Any]:
    """A rank's sharded state dict as snapshot values (references to the live tensors, no
    copies; the optimizer's padding zeroed): its main-replica tensors and objects, and its
    common state. ``sharded_state`` is consumed (factories applied in place)."""
    _zero_padding(sharded_state)
    apply_factories(sharded_state)
    _, persistent = extract_nonpersistent(sharded_state)
    sharded, common = extract_sharded_base(persistent)
    tensors: list[dict[str, Any]] = []
    objects: list[dict[str, Any]] = []

    def visit(x: Any) -> None:
        if isinstance(x, ShardedTensor):
            if not is_main_replica(x.replica_id):
                return
            offset, shape = box_of(x)
            if x.data is None:
                raise ConfigurationError(f"{x.key}: a ShardedTensor without data")
            tensors.append({"key": x.key, "global": list(x.global_shape),
                            "offset": list(offset), "data": x.data.detach().reshape(shape)})
        elif isinstance(x, ShardedObject):
            if is_main_replica(x.replica_id):
                objects.append({"key": x.key, "offset": [int(o) for o in x.global_offset],
                                "value": x.data})
        else:  # pragma: no cover - extract_sharded_base leaves ShardedBase only
            raise ConfigurationError(f"unexpected {type(x).__name__} in a sharded state dict")

    _walk(sharded, visit)
    return {"tensors": tensors, "objects": objects, "common": common}


@dataclass
class SavedPieces:
    """Every saved rank's pieces of the snapshot being restored, by key: the tensors' stored
    descriptors (read only when asked) and the objects' trees."""

    repo: Repository
    #: key -> (global shape, dtype, [(offset, box shape, descriptor)])
    tensors: dict[str, tuple[list[int], str, list[Shard]]] = field(default_factory=dict)
    #: (key, offset) -> the object's stored tree
    objects: dict[tuple[str, tuple[int, ...]], Any] = field(default_factory=dict)

    @classmethod
    def of(cls, repo: Repository, parts: list[dict[str, Any]], name: str) -> SavedPieces:
        """The pieces that the parts (a multi-rank body's ``ranks``) hold under ``name``."""
        out = cls(repo)
        for rank, part in enumerate(parts):
            tree = part.get(name)
            if not isinstance(tree, dict) or "tensors" not in tree:
                raise StateMismatch(f"rank {rank}'s part of the snapshot holds no Megatron "
                                    "state: it was not taken by MegatronSnapshots")
            for entry in tree["tensors"]:
                desc = TensorDescriptor.from_json(entry["data"]["$tensor"], entry["key"])
                shape, dtype, shards = out.tensors.setdefault(
                    entry["key"], (list(entry["global"]), desc.dtype, []))
                if list(entry["global"]) != shape or desc.dtype != dtype:
                    raise StateMismatch(f"{entry['key']}: saved ranks disagree on its global "
                                        "shape or dtype")
                shards.append(Shard(offsets=tuple(entry["offset"]), shape=desc.shape,
                                    nbytes=desc.nbytes, inline=desc.inline, chunks=desc.chunks))
            for entry in tree["objects"]:
                out.objects[(entry["key"], tuple(entry["offset"]))] = entry["value"]
        return out

    def descriptor(self, key: str) -> TensorDescriptor:
        """The global tensor ``key`` as one sharded descriptor of every saved box."""
        shape, dtype, shards = self.tensors[key]
        pieces = sorted(shards, key=lambda s: s.offsets)
        check_tiling(key, shape, pieces)
        return TensorDescriptor(dtype=dtype, shape=tuple(shape),
                                nbytes=math.prod(shape) * torch_dtype(dtype).itemsize,
                                shards=tuple(pieces))

    def read_object(self, key: str, offset: tuple[int, ...]) -> Any:
        tree = self.objects[(key, offset)]
        return load_trees(self.repo, {"value": tree})["value"]


def from_snapshot(live: dict[str, Any], own: dict[str, Any], saved: SavedPieces,
                  common: dict[str, Any]) -> dict[str, Any]:
    """The plain state dict to load, for the live sharded state dict ``live`` (built for
    loading): each box from this rank's own saved part ``own`` when it wrote that box, else
    read from ``saved``; the common state ``common`` (the saved one); Megatron's merges."""
    sharded, nonpersistent, factories = load_preprocess(live)
    sharded, _ = extract_sharded_base(sharded)
    mine: dict[Box, torch.Tensor] = {
        (e["key"], tuple(e["offset"]), tuple(e["data"].shape)): e["data"]
        for e in own["tensors"]}
    objects = {(e["key"], tuple(e["offset"])): e["value"] for e in own["objects"]}
    missing: list[str] = []
    changed: list[str] = []
    wanted: dict[Box, ShardedTensor] = {}

    def check(x: Any) -> None:
        if isinstance(x, ShardedTensor):
            offset, shape = box_of(x)
            if x.key not in saved.tensors:
                missing.append(x.key)
                return
            gshape, dtype, _ = saved.tensors[x.key]
            if gshape != list(x.global_shape) or dtype != dtype_name(x.dtype):
                changed.append(f"{x.key}: snapshot {dtype} {gshape}, live "
                               f"{dtype_name(x.dtype)} {list(x.global_shape)}")
            wanted[(x.key, offset, shape)] = x
        elif isinstance(x, ShardedObject):
            unique = (x.key, tuple(int(o) for o in x.global_offset))
            if unique not in objects and unique not in saved.objects:
                missing.append(f"{x.key} (object at {list(unique[1])})")

    _walk(sharded, check)
    if missing or changed:
        problems = [f"not in the snapshot: {', '.join(sorted(set(missing))[:10])}"] * bool(
            missing) + list(dict.fromkeys(changed))[:10]
        hint = ("Restore with the model configuration (and the optimizer's sharding type) "
                "that wrote it")
        if any(p.startswith("optimizer.distributed.") for p in problems):
            hint = ("The distributed optimizer's state (dp_reshardable, kept per TPxPP bucket) "
                    "restores onto another data-parallel size only: restore on the TP and PP "
                    "that wrote it, or restore the model alone (optimizer=None) and start a "
                    "new optimizer")
        raise StateMismatch("the snapshot's Megatron state does not fit this model and "
                            f"optimizer: {'; '.join(problems)}. {hint}")
    read: dict[Box, torch.Tensor] = {}
    others = [b for b in wanted if b not in mine]
    if others:
        with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ciuic-read") as pool:
            descs = {key: saved.descriptor(key) for key in {b[0] for b in others}}
            for b in others:
                read[b] = read_box(saved.repo, b[0], descs[b[0]], list(b[1]), list(b[2]), pool)

    def fill(x: Any) -> Any:
        if isinstance(x, ShardedTensor):
            offset, shape = box_of(x)
            b = (x.key, offset, shape)
            value = mine[b] if b in mine else read[b]
            return value.reshape(tuple(x.local_shape))
        if isinstance(x, ShardedObject):
            unique = (x.key, tuple(int(o) for o in x.global_offset))
            return objects[unique] if unique in objects else saved.read_object(*unique)
        return x

    dict_list_map_inplace(fill, sharded)
    state = common
    merge(state, nonpersistent)
    merge(state, sharded)
    return apply_factory_merges(state, factories)  # type: ignore[no-any-return]
