"""Global tensors across ranks: who writes what, and the sharded descriptor (docs/format.md,
"Distributed snapshots").

Every rank describes the tensors of its global states (model, optimizer) as *metas*: path,
dtype, global shape, and for a DTensor shard its offsets and local shape. From every rank's metas,
:func:`plan` decides, identically on every rank, who writes each piece:

- a plain tensor at a path that several ranks hold is a replica (DDP, or a replicated module): it
  is written once, by one of its holders; a replica marked not ``spread`` (a buffer, such as
  BatchNorm's running statistics, which ranks may hold differently until DDP re-broadcasts rank
  0's) is written by the lowest rank that holds it;
- a DTensor shard is written by one of the ranks holding that same box (replicated shards, as in
  HSDP, are written once too).

Owners are chosen greedily, largest piece first, to the holder with the fewest bytes so far, so
the writing is spread across ranks. :func:`assemble` then turns the owners' descriptors into the
snapshot's: a plain descriptor, or ``{"dtype", "shape", "nbytes", "shards": [...]}`` where each
shard has ``offsets``, ``shape``, ``nbytes`` and ``chunks`` (or ``inline``), checked to tile the
global tensor exactly.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import Any

import torch

from ciuic.errors import CaptureError, IntegrityError
from ciuic.format.descriptor import Shard, TensorDescriptor
from ciuic.format.digest import digest
from ciuic.format.stats import Stats, of_descriptor
from ciuic.format.tree import Leaf, dtype_name, torch_dtype

Meta = dict[str, Any]


def piece_key(path: str, offsets: list[int] | None) -> str:
    """The key of one written piece: the path, plus the box's offsets for a shard."""
    return path if offsets is None else f"{path}@{','.join(map(str, offsets))}"


def meta_of(leaf: Leaf) -> Meta:
    """What the plan needs to know about one leaf of a global state."""
    v = leaf.value
    dtype = dtype_name(v.dtype) if isinstance(v.dtype, torch.dtype) else str(v.dtype)
    local = [int(x) for x in v.shape]
    if leaf.shard is None:
        return {"path": leaf.path, "dtype": dtype, "shape": local, "offsets": None,
                "local": local, "nbytes": leaf.nbytes}
    shape, offsets = leaf.shard
    return {"path": leaf.path, "dtype": dtype, "shape": shape, "offsets": offsets,
            "local": local, "nbytes": leaf.nbytes}


def plan(metas: list[list[Meta]]) -> dict[str, int]:
    """piece key -> the rank that writes it, from every rank's metas (index = rank).

    Raises :class:`CaptureError` when ranks disagree about a tensor (dtype, global shape, plain
    on one rank and sharded on another).
    """
    seen: dict[str, Meta] = {}
    holders: dict[str, list[int]] = {}
    pinned: set[str] = set()  # replicas that may differ between ranks: the lowest rank's
    sizes: dict[str, int] = {}
    for rank, rank_metas in enumerate(metas):
        for meta in rank_metas:
            path = meta["path"]
            first = seen.setdefault(path, meta)
            for field in ("dtype", "shape"):
                if first[field] != meta[field]:
                    raise CaptureError(
                        f"{path}: {field} {first[field]} on one rank but {meta[field]} on rank "
                        f"{rank}; a tensor at the same path on several ranks must be a replica "
                        "or a shard of one global tensor")
            if (first["offsets"] is None) != (meta["offsets"] is None):
                raise CaptureError(f"{path}: a plain tensor on one rank but a DTensor shard on "
                                   f"rank {rank}")
            key = piece_key(path, meta["offsets"])
            holders.setdefault(key, []).append(rank)
            sizes[key] = int(meta["nbytes"])
            if not meta.get("spread", True):
                pinned.add(key)
    load = [0] * len(metas)
    owners: dict[str, int] = {}
    for key in sorted(holders, key=lambda k: (-sizes[k], k)):
        rank = (min(holders[key]) if key in pinned
                else min(holders[key], key=lambda r: (load[r], r)))
        owners[key] = rank
        load[rank] += sizes[key]
    return owners


def balanced(sizes: list[tuple[str, int, bool]], world_size: int) -> dict[str, int]:
    """piece key -> owner for pieces that every one of ``world_size`` ranks holds (``sizes``:
    key, bytes, pinned), as :func:`plan` assigns them from ``world_size`` equal metas, in
    O(pieces x log(world_size)) rather than O(pieces x world_size): largest first, each to the
    rank with the fewest bytes so far (the lowest rank on a tie); a pinned piece to rank 0."""
    load = [0] * world_size
    heap = [(0, r) for r in range(world_size)]  # (load, rank), stale entries skipped
    owners: dict[str, int] = {}
    for key, size, pinned in sorted(sizes, key=lambda x: (-x[1], x[0])):
        if pinned:
            rank = 0
        else:
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            rank = heapq.heappop(heap)[1]
        owners[key] = rank
        load[rank] += size
        heapq.heappush(heap, (load[rank], rank))
    return owners


def ruled(key: str, holders: tuple[int, ...], pinned: bool) -> int:
    """The owner of a box that ``holders`` hold (sorted global ranks), by rule: every holder,
    and every later reader, computes it alone. A pinned box (a buffer replicas may hold
    differently) is the lowest holder's; any other a holder chosen by the key's digest, which
    spreads the writing over the replicas."""
    if len(holders) == 1 or pinned:
        return holders[0]
    return holders[int(digest(key.encode())[:16], 16) % len(holders)]


@dataclass(frozen=True)
class Written:
    """One global piece as its owner wrote it: the tensor's path, the box's offsets (None for
    a plain tensor) and its descriptor (dtype, local shape, nbytes, chunks or inline)."""

    path: str
    offsets: list[int] | None
    desc: TensorDescriptor


def shard_of(offsets: list[int], desc: TensorDescriptor) -> Shard:
    """A written piece of a sharded tensor as a shard of it: its box's offsets and its bytes."""
    return Shard(offsets=tuple(offsets), shape=desc.shape, nbytes=desc.nbytes,
                 inline=desc.inline, chunks=desc.chunks, stats=desc.stats)


def assemble(leaves: list[Leaf], written: list[Written],
             split: dict[str, tuple[int, Stats | None]] | None = None) -> None:
    """Set the coordinator's global-state descriptors from every owner's pieces.

    ``leaves``: the coordinator's leaves of the global states (their descriptors are the
    tree's); ``written``: every owner's pieces. ``split``: a body in parts (format 3) -- each
    sharded tensor's shards are in the ranks' parts, and this gives, by path, the elements its
    shards hold together and its whole statistics; its descriptor says ``"split"``.
    """
    plain: dict[str, TensorDescriptor] = {}
    sharded: dict[str, list[tuple[str, Shard]]] = {}  # (dtype, shard)
    for w in written:
        if w.offsets is None:
            plain[w.path] = w.desc
        else:
            sharded.setdefault(w.path, []).append((w.desc.dtype, shard_of(w.offsets, w.desc)))
    for leaf in leaves:
        if leaf.shard is None:
            desc = plain.get(leaf.path)
            if desc is None:
                raise IntegrityError(f"{leaf.path}: no rank wrote this tensor")
        elif split is not None:
            desc = _split(leaf, *split.get(leaf.path, (0, None)))
        else:
            shape, _ = leaf.shard
            pieces = sorted(sharded.get(leaf.path, []), key=lambda s: s[1].offsets)
            check_tiling(leaf.path, shape, [s for _, s in pieces])
            if len({dtype for dtype, _ in pieces}) > 1:
                raise IntegrityError(f"{leaf.path}: shards of different dtypes")
            dtype = pieces[0][0]
            desc = TensorDescriptor(dtype=dtype, shape=tuple(shape),
                                    nbytes=math.prod(shape) * torch_dtype(dtype).itemsize,
                                    shards=tuple(s for _, s in pieces))
            whole = of_descriptor(desc.to_json())  # the shards' statistics combined, if any
            if whole is not None:
                desc = dataclasses.replace(desc, stats=whole.to_json())
        leaf.describe(desc)


def _split(leaf: Leaf, volume: int, stats: Stats | None) -> TensorDescriptor:
    """The index's descriptor of a sharded tensor whose shards are in the ranks' parts."""
    assert leaf.shard is not None
    shape, _ = leaf.shard
    if volume != math.prod(shape):
        raise IntegrityError(f"{leaf.path}: the ranks' shards hold {volume} of its "
                             f"{math.prod(shape)} elements")
    dtype = meta_of(leaf)["dtype"]
    return TensorDescriptor(dtype=dtype, shape=tuple(shape),
                            nbytes=math.prod(shape) * torch_dtype(dtype).itemsize,
                            stats=None if stats is None else stats.to_json(),
                            extra={"split": True})


def check_tiling(path: str, shape: list[int], shards: list[Shard]) -> None:
    """The shards lie inside the global tensor, at distinct offsets, and their volumes add up
    to its volume (DTensor shards never overlap, so this means they tile it)."""
    if not shards:
        raise IntegrityError(f"{path}: no shard of this tensor was written")
    volume: int = 0
    offsets = set()
    for s in shards:
        off, size = s.offsets, s.shape
        if len(off) != len(shape) or len(size) != len(shape) or any(
                o < 0 or n < 0 or o + n > g for o, n, g in zip(off, size, shape, strict=True)):
            raise IntegrityError(f"{path}: shard at {list(off)} of shape {list(size)} lies "
                                 f"outside the global shape {shape}")
        if off in offsets and math.prod(size) > 0:
            raise IntegrityError(f"{path}: two shards at offsets {list(off)}")
        offsets.add(off)
        volume += math.prod(size)
    if volume != math.prod(shape):
        raise IntegrityError(f"{path}: shards cover {volume} of {math.prod(shape)} elements")
