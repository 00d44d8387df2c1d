"""The training side of the host-memory tier: staging buffers in shared memory that the
supervisor holds, so that the latest snapshot's bytes outlive the training process.

Under ``ciuic run`` the staging buffers an asynchronous snapshot copies the state into are
``memfd`` regions handed to the supervisor (:mod:`~ciuic.supervisor.holder`). They are the one
host copy of the state that ciuic keeps anyway, so the tier costs no second copy. Each snapshot:

1. before staging, the rank *invalidates* its host copy (the buffers are about to change);
2. after the commit, it *publishes* which snapshot the buffers hold: where each leaf lies, and
   where each chunk it wrote lies (by digest).

A process that dies between the two leaves no valid host copy, and its restart restores from the
store; one that dies after a commit leaves the buffers of the snapshot it committed, which the
restarted process maps again. Every rank of the node may also map the chunks the others
published, lent read-only (:meth:`HostTier.node_chunks`): a restore takes any chunk it needs
from there. Every chunk taken from memory is checked against the manifest's digest
(:func:`ciuic.chain.read.take_chunk`); a chunk that differs is read from the store.

A leaf of :data:`MIN_BYTES` or more gets a ``memfd`` of its own; smaller ones (biases, RNG
states, counters) share *arenas* of :data:`ARENA_BYTES`, so that a state of many small tensors
costs few descriptors, and a restore takes them from memory too.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ciuic.format.chunks import HEADER_BYTES
from ciuic.format.descriptor import TensorDescriptor
from ciuic.supervisor.channel import Link

log = logging.getLogger("ciuic")
MIN_BYTES = 64 * 1024
ARENA_BYTES = 4 << 20
_ALIGN = 64  # a leaf in an arena starts on a cache line
#: A shared buffer starts this far into its memfd, as every staging buffer starts past a page
#: boundary: its chunks then go to the disk with direct I/O (engine/staging.allocate_host).
SKEW = HEADER_BYTES


@dataclass
class _Arena:
    id: int
    region: mmap.mmap
    used: int = 0


class HostTier:
    """A rank's shared staging buffers and their host copy (see the module's docstring)."""

    def __init__(self, link: Link, attached: dict[str, Any]) -> None:
        self._link = link
        self.enabled = bool(attached.get("tier"))
        #: data_ptr of a buffer handed out -> (its memfd's id, its offset in it)
        self._where: dict[int, tuple[int, int]] = {}
        self._next = 1
        self._lock = threading.Lock()
        self._arena: _Arena | None = None
        self._freed: collections.deque[int] = collections.deque()
        #: the snapshot a previous process of this rank left in host memory, and its buffers
        self.snapshot: str | None = None
        self.step: int | None = None
        self.adopted: dict[str, torch.Tensor] = {}
        copy = attached.get("copy")
        if self.enabled and copy:
            try:
                self._adopt(copy)
            except (OSError, ValueError, KeyError, ConnectionError) as e:
                log.warning("the host-memory copy of snapshot %s could not be mapped (%s); "
                            "restoring from the store", str(copy.get("snapshot"))[:12], e)
                self.adopted.clear()

    def _adopt(self, copy: dict[str, Any]) -> None:
        buffers = [(int(i), int(n)) for i, n in copy["buffers"]]
        leaves = [(str(p), int(i), int(off), int(n)) for p, i, off, n in copy["leaves"]]
        regions = {}
        fds = self._link.descriptors([i for i, _ in buffers])
        try:
            for (i, n), fd in zip(buffers, fds, strict=True):
                regions[i] = self._region(fd, i, n)
        finally:
            for fd in fds:
                os.close(fd)
        for path, i, off, n in leaves:
            self.adopted[path] = self._hand_out(regions[i], i, off, n)
        self.snapshot, self.step = str(copy["snapshot"]), int(copy["step"])
        self._next = max([i for i, _ in buffers], default=0) + 1

    def _region(self, fd: int, i: int, nbytes: int) -> mmap.mmap:
        """Map memfd ``i``; the supervisor is told to close it once nothing maps it here."""
        region = mmap.mmap(fd, SKEW + nbytes)
        weakref.finalize(region, self._freed.append, i)
        return region

    def _hand_out(self, region: mmap.mmap, i: int, off: int, nbytes: int) -> torch.Tensor:
        buf = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=SKEW + off)
        ptr = buf.data_ptr()
        self._where[ptr] = (i, off)
        weakref.finalize(buf, self._forget, ptr, i, off)
        return buf

    def _forget(self, ptr: int, i: int, off: int) -> None:
        if self._where.get(ptr) == (i, off):
            del self._where[ptr]

    def _call(self, message: dict[str, Any], fds: list[int] = ()  # type: ignore[assignment]
              ) -> dict[str, Any] | None:
        # a finalizer may run on any thread, inside a request: freed memfds are only noted
        # there, and told with the next request
        if self._freed and message["op"] != "free":
            freed = []
            while self._freed:  # deque: atomic against a finalizer's append
                freed.append(self._freed.popleft())
            self._call({"op": "free", "ids": freed})
        try:
            reply, got = self._link.request(message, fds)
        except (OSError, ValueError, ConnectionError) as e:
            if self.enabled:
                log.warning("the supervisor's channel failed (%s): no host-memory copy from "
                            "now on; snapshots go to the store as before", e)
            self.enabled = False
            return None
        for fd in got:
            os.close(fd)
        return reply

    def _new_memfd(self, name: str, nbytes: int) -> tuple[int, mmap.mmap] | None:
        """A new memfd of ``nbytes`` handed to the supervisor: (its id, its mapping), or None
        (no tier any more, or over its budget: logged)."""
        with self._lock:
            i, self._next = self._next, self._next + 1
        # the supervisor seals it against resizing, so that no mapping of it faults
        fd = os.memfd_create(f"ciuic:{name[-200:]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, SKEW + nbytes)
            region = self._region(fd, i, nbytes)
            reply = self._call({"op": "put", "id": i, "path": name, "nbytes": nbytes}, [fd])
        finally:
            os.close(fd)
        if reply is None or not reply.get("ok"):
            if reply is not None and self.enabled:
                log.warning("host-memory copy off: %s", reply.get("why"))
                self.enabled = False
            return None
        return i, region

    def allocate(self, path: str, nbytes: int) -> torch.Tensor | None:
        """A shared staging buffer of ``nbytes`` for ``path``, or None (ordinary memory)."""
        if not self.enabled or nbytes <= 0:
            return None
        if nbytes < MIN_BYTES:
            return self._small(nbytes)
        made = self._new_memfd(path, nbytes)
        return None if made is None else self._hand_out(made[1], made[0], 0, nbytes)

    def _small(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` from the current arena (a new one when it is full)."""
        with self._lock:
            arena = self._arena
            if arena is not None and arena.used + nbytes <= ARENA_BYTES:
                off = arena.used
                arena.used = -(-(off + nbytes) // _ALIGN) * _ALIGN
                return self._hand_out(arena.region, arena.id, off, nbytes)
        made = self._new_memfd("arena", ARENA_BYTES)
        if made is None:
            return None
        with self._lock:
            # the arena it replaces is freed when the last leaf in it is
            self._arena = arena = _Arena(made[0], made[1], -(-nbytes // _ALIGN) * _ALIGN)
            return self._hand_out(arena.region, arena.id, 0, nbytes)

    def invalidate(self) -> None:
        """The buffers are about to change: no host copy until the next :meth:`publish`."""
        if self.snapshot is not None and self.enabled:
            self._call({"op": "invalidate"})
        self.snapshot = None

    def publish(self, snapshot: str, step: int, buffers: Mapping[str, torch.Tensor],
                written: Mapping[str, TensorDescriptor]) -> None:
        """The buffers (path -> staging buffer) hold ``snapshot``; ``written``: the
        descriptors of the leaves this process wrote (their chunks' digests), by path."""
        if not self.enabled:
            return
        ids: set[int] = set()
        leaves: list[list[Any]] = []
        chunks: list[list[Any]] = []
        for path, buf in buffers.items():
            where = self._where.get(buf.data_ptr())
            if where is None:
                continue
            i, off = where
            ids.add(i)
            leaves.append([path, i, off, buf.numel()])
            desc = written.get(path)
            if desc is None or desc.chunks is None or desc.nbytes != buf.numel():
                continue
            at = off
            for c in desc.chunks:
                chunks.append([c.digest, c.nbytes, i, at])
                at += c.nbytes
        if not ids:
            return
        reply = self._call({"op": "publish", "snapshot": snapshot, "step": step,
                            "ids": sorted(ids), "leaves": leaves, "chunks": chunks})
        if reply and reply.get("ok"):
            self.snapshot, self.step = snapshot, step
        else:
            self.snapshot = None

    def node_chunks(self) -> dict[str, memoryview]:
        """Every chunk this node's ranks published (this one's included), by digest, mapped
        read-only. Empty where there is none, or the supervisor cannot give them (logged)."""
        if not self.enabled:
            return {}
        reply = self._call({"op": "chunks"})
        if not reply or not reply.get("ok"):
            return {}
        regions: dict[tuple[int, int], memoryview] = {}
        owners: dict[int, list[tuple[int, int]]] = {}
        for owner, i, n in reply["buffers"]:
            owners.setdefault(int(owner), []).append((int(i), int(n)))
        for owner, buffers in owners.items():
            try:
                fds = self._link.descriptors([i for i, _ in buffers], owner)
            except (OSError, ValueError, ConnectionError) as e:  # it published anew meanwhile
                log.debug("the buffers of rank %d could not be mapped: %s", owner, e)
                continue
            try:
                for (i, n), fd in zip(buffers, fds, strict=True):
                    regions[owner, i] = memoryview(mmap.mmap(fd, SKEW + n,
                                                             prot=mmap.PROT_READ))
            finally:
                for fd in fds:
                    os.close(fd)
        found: dict[str, memoryview] = {}
        for d, n, owner, i, off in reply["chunks"]:
            region = regions.get((int(owner), int(i)))
            if region is not None:
                found.setdefault(str(d), region[SKEW + int(off):SKEW + int(off) + int(n)])
        return found
