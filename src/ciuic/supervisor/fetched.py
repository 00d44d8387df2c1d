"""Chunks this node's ranks read from other nodes' memory, fetched once per node: the node's
``ciuic run`` fetches a chunk the first time one of its ranks asks for it (``fetch`` on the
local channel), keeps it in a sealed ``memfd``, and hands the descriptor to every rank that
asks for it next; a rank that asks while the chunk is on its way waits for that fetch instead of
starting another. So a replaced node whose ranks all need the same bytes (DDP: every rank the
whole model) takes each chunk across the network once, not once per rank.

The node's ciuic run does not check what it fetched: the rank that uses a chunk checks it
against its digest, as every chunk taken from memory, and reads one that differs from the
store. The fetched chunks count against ``--host-memory``; one that does not fit is handed to
the rank that asked and not kept. They are dropped when one of the node's ranks publishes a
newer snapshot (they served the restore before it), or when the memory is released.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ciuic.supervisor.channel import Link, seal

log = logging.getLogger("ciuic")

#: how long a rank's request waits for the same chunk's fetch in flight (the peer's own
#: timeout is 30 s)
WAIT_S = 60.0


@dataclass
class _Kept:
    fd: int
    nbytes: int


class Fetched:
    """The node's single-flight cache of chunks fetched from other nodes (its index shares the
    holder's lock; the fetches themselves run outside it)."""

    def __init__(self, lock: threading.Lock, room: Callable[[int], bool]) -> None:
        self._lock = lock
        self._room = room
        self._arrived = threading.Condition(lock)
        self._kept: dict[str, _Kept] = {}
        self._flight: set[str] = set()
        #: digests no other node held, since the last clear (each is asked for once)
        self._absent: set[str] = set()
        self._epoch = 0

    def held(self) -> int:
        """Bytes kept (call with the lock held)."""
        return sum(k.nbytes for k in self._kept.values())

    def clear(self) -> None:
        """Drop every kept chunk (call with the lock held): a newer snapshot was published, or
        the memory is released. A fetch in flight is not kept."""
        for k in self._kept.values():
            os.close(k.fd)
        self._kept.clear()
        self._absent.clear()
        self._epoch += 1

    def get(self, d: str, n: int, read: Callable[[str, memoryview], bool]
            ) -> tuple[int, bool] | None:
        """A descriptor of chunk ``d`` (``n`` bytes, at offset 0; the caller closes it) and
        whether this call fetched it from another node (False: it was kept here, another rank
        fetched it); None where no other node gave it. ``read(d, dest)`` fetches it."""
        with self._lock:
            deadline = None
            while True:
                kept = self._kept.get(d)
                if kept is not None and kept.nbytes == n:
                    return os.dup(kept.fd), False
                if d in self._absent:
                    return None
                if d not in self._flight:
                    break
                deadline = deadline or time.monotonic() + WAIT_S
                if not self._arrived.wait(max(0.0, deadline - time.monotonic())):
                    break  # the fetch in flight takes too long: fetch it here too
            self._flight.add(d)
            epoch = self._epoch
        fd: int | None = None
        try:
            fd = os.memfd_create("ciuic-fetched", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, n)
            with mmap.mmap(fd, n) as region:
                view = memoryview(region)
                try:
                    got = read(d, view)
                finally:
                    view.release()
            if not got:
                os.close(fd)
                fd = None
                with self._lock:
                    if epoch == self._epoch:
                        self._absent.add(d)
                return None
            seal(fd)
            with self._lock:
                if epoch == self._epoch and d not in self._kept and self._room(n):
                    self._kept[d] = _Kept(fd, n)
                    out, fd = os.dup(fd), None
                    return out, True
            out, fd = fd, None  # not kept: the rank's descriptor is the only one
            return out, True
        finally:
            if fd is not None:
                os.close(fd)
            with self._lock:
                self._flight.discard(d)
                self._arrived.notify_all()


# -- a rank's side -------------------------------------------------------------------------


class NodeReads:
    """A rank's reads of the chunks its node lacks, through its node's ``ciuic run`` (for one
    restore): each reading thread has a channel connection of its own, so that the rank's
    fetches run side by side. :meth:`read` says where the bytes came from; the caller checks
    them against their digest."""

    def __init__(self, supervisor: str, rank: int, secret: str) -> None:
        self._name = supervisor
        self._rank = rank
        self._secret = secret
        self._local = threading.local()
        self._links: list[Link] = []
        self._lock = threading.Lock()

    def _link(self) -> Link:
        link: Link | None = getattr(self._local, "link", None)
        if link is None:
            link = self._local.link = Link(self._name, self._rank, self._secret,
                                          timeout=2 * WAIT_S)
            with self._lock:
                self._links.append(link)
        return link

    def read(self, d: str, dest: memoryview) -> Literal["fetched", "node"] | None:
        """Chunk ``d`` into ``dest`` (its length): "fetched" where this request made it cross
        the network, "node" where another rank of the node had fetched it (it was in the
        node's memory); None where no other node holds it, or the node's ciuic run could not
        fetch it (logged; the caller reads the store)."""
        n = len(dest)
        try:
            reply, fds = self._link().request({"op": "fetch", "d": d, "n": n})
        except (OSError, ValueError, ConnectionError) as e:
            log.warning("asking this node's ciuic run for chunk %s failed (%s): from the "
                        "store", d[:12], e)
            broken: Link | None = getattr(self._local, "link", None)
            self._local.link = None
            if broken is not None:
                broken.close()
            return None
        try:
            if not reply.get("ok") or len(fds) != 1:
                return None
            with mmap.mmap(fds[0], n, prot=mmap.PROT_READ) as region:
                view = memoryview(region)
                try:
                    dest[:] = view
                finally:
                    view.release()
        finally:
            for fd in fds:
                os.close(fd)
        return "fetched" if reply.get("fetched") else "node"

    def close(self) -> None:
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
