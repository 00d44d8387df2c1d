"""Reading snapshots back: manifest -> body -> verified chunks -> tensors. Never unpickles.

Every byte is checked before use: the manifest against its ID, the body against the manifest,
each chunk against its name and length. Damage raises :class:`~ciuic.errors.CorruptObject`
naming the object; a missing object raises it too (as "missing").
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ciuic.chain.read import READ_THREADS, read_body
from ciuic.chain.repo import Repository
from ciuic.format import manifest as mf
from ciuic.format.descriptor import ChunkRef, TensorDescriptor
from ciuic.format.info import SnapshotInfo
from ciuic.format.tree import decode, walk_leaves
from ciuic.restore.boxread import box_refs, read_box
from ciuic.restore.leaves import leaf_buffer, materialize
from ciuic.restore.sources import BufferFor, Resident, pack_runs


def load_states(repo: Repository, info: SnapshotInfo, skip: Collection[str] = (),
                buffer_for: BufferFor | None = None, *, adapt: bool = True
                ) -> tuple[mf.Manifest, dict[str, Any]]:
    """Read and verify a snapshot's states (all but those in ``skip``) as Python values.

    Every read is in flight at once (a thread pool), straight into its tensor's memory, which is
    never zero-filled first. ``buffer_for(path, nbytes)`` may lend a flat uint8 buffer to read a
    leaf into (reused memory); it returns None to let the reader allocate one. Everything is
    read and checked before anything is returned, so a damaged snapshot never reaches live
    objects. ``adapt=False`` leaves adapted values (format/adapters.py) as plain trees.
    """
    m, states = read_body(repo, info)
    wanted = {k: v for k, v in states.items() if k not in skip}
    return m, load_trees(repo, wanted, buffer_for, adapt=adapt)


def load_trees(repo: Repository, wanted: dict[str, Any], buffer_for: BufferFor | None = None,
               *, adapt: bool = True, resident: Resident | None = None) -> dict[str, Any]:
    """Read, verify and decode state trees (name -> tree) into Python values.

    Buffers are kept per descriptor, not per path: snapshots written before ciuic refused
    dict keys of equal text (``{0: a, "0": b}``) hold two leaves under one path, and each
    must come back as itself (the repeated path is not lent a buffer either). ``resident``:
    the leaves' bytes already in host memory, each chunk checked before use."""
    buffers: dict[int, torch.Tensor] = {}  # id(descriptor) -> its bytes
    parsed: dict[int, TensorDescriptor] = {}  # id(descriptor) -> its typed form
    reads: list[Future[None]] = []
    sharded: list[tuple[str, dict[str, Any]]] = []
    lent: set[str] = set()

    def lend_once(path: str, nbytes: int) -> torch.Tensor | None:
        if buffer_for is None or path in lent:
            return None
        lent.add(path)
        return buffer_for(path, nbytes)

    leaves = [(path, kind, raw) for path, kind, raw in walk_leaves(wanted)]
    for path, _kind, raw in leaves:
        parsed[id(raw)] = TensorDescriptor.from_json(raw, path)
    # in the order they are read below: whole leaves first, then the sharded ones
    order = sorted(leaves, key=lambda leaf: leaf[1] == "tensor"
                   and parsed[id(leaf[2])].shards is not None)
    runs = pack_runs(repo, resident, (ref for path, kind, raw in order for ref in _refs(
        path, kind, parsed[id(raw)], resident)))
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ciuic-read") as pool, \
            runs if runs is not None else contextlib.nullcontext():
        try:
            for path, kind, raw in leaves:  # every read in flight at once
                desc = parsed[id(raw)]
                if desc.shards is not None and kind == "tensor":
                    sharded.append((path, raw))  # assembled below, while the rest reads
                    continue
                buffers[id(raw)], submitted = leaf_buffer(repo, path, kind, desc, pool,
                                                           lend_once, resident, runs)
                reads.extend(submitted)
            if sharded:
                for path, raw in sharded:
                    buffers[id(raw)] = read_box(repo, path, parsed[id(raw)], None, None,
                                                pool, resident, runs
                                                ).reshape(-1).view(torch.uint8)
            for fut in reads:
                fut.result()
        finally:
            for fut in reads:
                fut.cancel()

    def load_leaf(path: str, kind: str, desc: dict[str, Any]) -> Any:
        return materialize(path, kind, parsed[id(desc)], buffers[id(desc)])

    return {name: decode(tree, name, load_leaf, adapt=adapt) for name, tree in wanted.items()}


def _refs(path: str, kind: str, desc: TensorDescriptor, resident: Resident | None
          ) -> list[ChunkRef]:
    """The chunks a leaf's restore reads (none where this rank's memory holds the leaf)."""
    if kind == "tensor" and desc.shards is not None:
        return box_refs(path, desc, None, None)
    if resident is not None and resident.get(path, desc.nbytes) is not None:
        return []
    return list(desc.chunks or ())
