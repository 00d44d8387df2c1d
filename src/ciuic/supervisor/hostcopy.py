"""The training side of the host-memory tier: staging buffers in shared memory that the
supervisor holds, so that the latest snapshot's bytes outlive the training process.

Under ``ciuic run`` the staging buffers an asynchronous snapshot copies the state into are
``memfd`` regions handed to the supervisor (:mod:`~ciuic.supervisor.channel`). They are the one
host copy of the state that ciuic keeps anyway, so the tier costs no second copy. Each snapshot:

1. before staging, the rank *invalidates* its host copy (the buffers are about to change);
2. after the commit, it *publishes* which snapshot the buffers hold.

A process that dies between the two leaves no valid host copy, and its restart restores from the
store; one that dies after a commit leaves the buffers of the snapshot it committed, which the
restarted process maps again. A restore from them checks every chunk against the manifest's
digest (:func:`ciuic.chain.read.take_chunk`); a chunk that differs is read from the store.

Buffers under :data:`MIN_BYTES` stay in ordinary memory (their restore reads the store; they are
a few kilobytes), so that a state of many small tensors does not cost a descriptor each.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import threading
import weakref
from typing import Any

import torch

from ciuic.format.chunks import HEADER_BYTES
from ciuic.supervisor.channel import Link

log = logging.getLogger("ciuic")
MIN_BYTES = 64 * 1024
#: A shared buffer starts this far into its memfd, as every staging buffer starts past a page
#: boundary: its chunks then go to the disk with direct I/O (engine/staging.allocate_host).
SKEW = HEADER_BYTES


class HostTier:
    """A rank's shared staging buffers and their host copy (see the module's docstring)."""

    def __init__(self, link: Link, attached: dict[str, Any]) -> None:
        self._link = link
        self.enabled = bool(attached.get("tier"))
        self._ids: dict[int, int] = {}  # data_ptr of a shared buffer -> its id
        self._next = 1
        self._lock = threading.Lock()
        self._freed: collections.deque[int] = collections.deque()
        #: the snapshot a previous process of this rank left in host memory, and its buffers
        self.snapshot: str | None = None
        self.step: int | None = None
        self.adopted: dict[str, torch.Tensor] = {}
        copy = attached.get("copy")
        if self.enabled and copy:
            try:
                self._adopt(copy)
            except (OSError, ValueError, ConnectionError) as e:
                log.warning("the host-memory copy of snapshot %s could not be mapped (%s); "
                            "restoring from the store", str(copy.get("snapshot"))[:12], e)
                self.adopted.clear()

    def _adopt(self, copy: dict[str, Any]) -> None:
        entries = [(str(p), int(i), int(n)) for p, i, n in copy["entries"]]
        fds = self._link.descriptors([i for _, i, _ in entries])
        try:
            for (path, i, n), fd in zip(entries, fds, strict=True):
                buf = torch.frombuffer(mmap.mmap(fd, SKEW + n), dtype=torch.uint8, count=n,
                                       offset=SKEW)
                self._track(buf, i)
                self.adopted[path] = buf
        finally:
            for fd in fds:
                os.close(fd)
        self.snapshot, self.step = str(copy["snapshot"]), int(copy["step"])
        self._next = max([i for _, i, _ in entries], default=0) + 1

    def _track(self, buf: torch.Tensor, i: int) -> None:
        self._ids[buf.data_ptr()] = i
        weakref.finalize(buf, self._free, buf.data_ptr(), i)

    def _free(self, ptr: int, i: int) -> None:
        # a finalizer may run on any thread, inside a request: only noted here, sent with the
        # next request
        if self._ids.get(ptr) == i:
            del self._ids[ptr]
        self._freed.append(i)

    def _call(self, message: dict[str, Any], fds: list[int] = ()  # type: ignore[assignment]
              ) -> dict[str, Any] | None:
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

    def allocate(self, path: str, nbytes: int) -> torch.Tensor | None:
        """A shared staging buffer of ``nbytes`` for ``path``, or None (ordinary memory)."""
        if not self.enabled or nbytes < MIN_BYTES:
            return None
        with self._lock:
            i, self._next = self._next, self._next + 1
        fd = os.memfd_create(f"ciuic:{path[-200:]}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, SKEW + nbytes)
            region = mmap.mmap(fd, SKEW + nbytes)
            reply = self._call({"op": "put", "id": i, "path": path, "nbytes": nbytes}, [fd])
        finally:
            os.close(fd)
        if reply is None or not reply.get("ok"):
            if reply is not None and self.enabled:
                log.warning("host-memory copy off: %s", reply.get("why"))
                self.enabled = False
            region.close()
            return None
        buf = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=SKEW)
        self._track(buf, i)
        return buf

    def invalidate(self) -> None:
        """The buffers are about to change: no host copy until the next :meth:`publish`."""
        if self.snapshot is not None and self.enabled:
            self._call({"op": "invalidate"})
        self.snapshot = None

    def publish(self, snapshot: str, step: int, buffers: list[torch.Tensor]) -> None:
        """Every buffer of ``buffers`` that is shared now holds ``snapshot``."""
        if not self.enabled:
            return
        ids = [self._ids[b.data_ptr()] for b in buffers if b.data_ptr() in self._ids]
        if not ids:
            return
        reply = self._call({"op": "publish", "snapshot": snapshot, "step": step, "ids": ids})
        if reply and reply.get("ok"):
            self.snapshot, self.step = snapshot, step
        else:
            self.snapshot = None
