"""The supervisor's end of the channel (:mod:`ciuic.supervisor.channel`): it serves the
node's ranks, keeps their staging buffers, the heartbeat region, and an index of the chunks the
buffers hold.

Each rank hands over its staging buffers (``put``: a ``memfd`` the holder keeps open), says
before it changes them that they hold nothing (``invalidate``), and after a commit *publishes*
what they hold: where each leaf of the snapshot lies (path, buffer, offset, length: its own
restart maps them back by path) and where each chunk it wrote lies (digest, length, buffer,
offset). The published chunks of every rank of the node form the node's index (``chunks``): a
restoring rank maps the buffers it names (``fds`` of another rank's published buffer) and takes
any chunk its snapshot needs from there, checked against the digest, whoever wrote it. So a rank
whose own copy is gone, or that needs replicas another rank wrote (DDP), reads memory, not the
store.

A training process that dies leaves its buffers here, for the next start. When the supervisor
exits, or is killed, the kernel closes its descriptors, and the memory is freed once no process
maps it any more: nothing can leak. The holder keeps at most ``budget`` bytes; a buffer that
would exceed it releases every host copy (a partial copy would serve no restore), and training
goes on with ordinary memory.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from ciuic.supervisor import beat
from ciuic.supervisor.channel import FDS_PER_MESSAGE, receive, send
from ciuic.supervisor.nodes import NodeService

log = logging.getLogger("ciuic")


@dataclass
class _Buffer:
    fd: int
    nbytes: int


@dataclass
class _Rank:
    buffers: dict[int, _Buffer] = field(default_factory=dict)
    #: the snapshot the buffers of ``ids`` hold, as the rank published it at its commit
    snapshot: str | None = None
    step: int | None = None
    ids: list[int] = field(default_factory=list)
    #: [path, buffer id, offset, bytes] of each leaf of the published snapshot
    leaves: list[list[Any]] = field(default_factory=list)
    #: [digest, bytes, buffer id, offset] of each chunk the rank wrote
    chunks: list[list[Any]] = field(default_factory=list)

    def unpublish(self) -> None:
        self.snapshot, self.step, self.ids, self.leaves, self.chunks = None, None, [], [], []

    def published(self) -> bool:
        return self.snapshot is not None and all(i in self.buffers for i in self.ids)


class Holder(NodeService):
    """The supervisor's end: serves attaches, keeps the buffers, and the heartbeat region;
    on a job of several nodes, serves this node's chunks to the others and keeps ``replicas``
    of the next nodes' (:class:`~ciuic.supervisor.nodes.NodeService`)."""

    def __init__(self, budget: int | None, replicas: int = 1, peer_timeout_s: float = 10.0
                 ) -> None:
        self.name = f"ciuic-run-{os.getpid()}-{secrets.token_hex(6)}"
        self.budget = budget  # None: no host-memory tier
        self._fd = os.memfd_create("ciuic-beats", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, beat.REGION_BYTES)
        self.beats = mmap.mmap(self._fd, beat.REGION_BYTES)
        self._ranks: dict[int, _Rank] = {}
        self._lock = threading.Lock()
        self.released: str | None = None  # why the host copy was released, once it was
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._closed = False
        self._init_nodes(replicas, peer_timeout_s)
        threading.Thread(target=self._accept, name="ciuic-run-accept", daemon=True).start()

    def copies(self) -> dict[int, tuple[str | None, int | None, int]]:
        """rank -> (snapshot, step, bytes) of each rank's published host copy."""
        with self._lock:
            return {rank: (r.snapshot, r.step, sum(r.buffers[i].nbytes for i in r.ids
                                                   if i in r.buffers))
                    for rank, r in self._ranks.items()}

    def clear_beats(self) -> None:
        """Before a start: the slots of the last start no longer count."""
        self.beats[:] = bytes(beat.REGION_BYTES)

    def release(self, why: str) -> None:
        """Close every buffer: the host copy is gone (the job ended, or it went over budget)."""
        with self._lock:
            self._release(why)

    def _release(self, why: str) -> None:
        self.fetched.clear()
        ranks, self._ranks = self._ranks, {}
        for r in ranks.values():
            for b in r.buffers.values():
                os.close(b.fd)
        if why != "closed" and self.budget is not None:
            self.released = why

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_nodes()
        self.release("closed")
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self.beats.close()
        os.close(self._fd)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="ciuic-run-rank",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    message, fds = receive(conn)
                except (OSError, ValueError):
                    return
                if message is None:
                    return
                owned = message.get("op") == "fetch"  # its descriptor is closed once sent
                try:
                    if owned:
                        for fd in fds:
                            os.close(fd)
                        reply, out = self._fetch(message)
                    else:
                        reply, out = self._handle(message, fds)
                except Exception as e:  # a malformed request: answered, never fatal here
                    reply, out = {"ok": False, "why": f"{type(e).__name__}: {e}"}, []
                try:
                    send(conn, reply, out)
                except OSError:
                    return
                finally:
                    if owned:
                        for fd in out:
                            os.close(fd)

    def _handle(self, m: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """The reply to one request, and descriptors to send with it. Takes ``fds``: each is
        kept (a put's buffer) or closed, also when the request raises."""
        op = m.get("op")
        if op != "put":
            for fd in fds:  # only a put hands over a descriptor
                os.close(fd)
        elif len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise ValueError("put takes one descriptor")
        try:
            rank = int(m.get("rank", 0))
            return self._handle_locked(op, rank, m, fds)
        except BaseException:
            if op == "put":  # _put raises only before it keeps or closes the descriptor
                os.close(fds[0])
            raise

    def _handle_locked(self, op: Any, rank: int, m: dict[str, Any], fds: list[int]
                       ) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            r = self._ranks.setdefault(rank, _Rank())
            if op == "attach":
                return self._attach(r), [self._fd]
            if op == "fds":
                return self._fds(r, m)
            if op == "put":
                return self._put(r, m, fds), []
            if op == "free":
                for i in m["ids"]:
                    b = r.buffers.pop(int(i), None)
                    if b is not None:
                        os.close(b.fd)
                    if int(i) in r.ids:  # a published buffer is gone: no host copy
                        r.unpublish()
                        self._generation += 1
                return {"ok": True}, []
            if op == "invalidate":
                r.unpublish()
                self._generation += 1
                return {"ok": True}, []
            if op == "publish":
                return self._publish(r, m), []
            if op == "chunks":
                return self._index(), []
            if op == "listen":
                return self._listen(), []
            if op == "peers":
                return self._join(m), []
        raise ValueError(f"unknown request {op!r}")

    def _attach(self, r: _Rank) -> dict[str, Any]:
        # buffers the last process registered but did not publish are garbage now
        keep = set(r.ids) if r.snapshot is not None else set()
        for i in [i for i in r.buffers if i not in keep]:
            os.close(r.buffers.pop(i).fd)
        copy = None
        if r.published():
            copy = {"snapshot": r.snapshot, "step": r.step,
                    "buffers": [[i, r.buffers[i].nbytes] for i in r.ids], "leaves": r.leaves}
        return {"ok": True, "tier": self.budget is not None and self.released is None,
                "copy": copy, "why": self.released, "restart": self.restart}

    def _fds(self, r: _Rank, m: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        ids = [int(i) for i in m["ids"]][:FDS_PER_MESSAGE]
        owner = m.get("owner")
        if owner is not None and int(owner) < 0:  # a replica of node -1 - owner
            return self._replica_fds(int(owner), ids)
        if owner is not None and int(owner) != int(m.get("rank", 0)):
            other = self._ranks.get(int(owner))  # another rank's: only what it published
            if other is None or not other.published() or not set(ids) <= set(other.ids):
                return {"ok": False, "why": f"rank {owner} no longer publishes these buffers"}, []
            r = other
        if not all(i in r.buffers for i in ids):
            return {"ok": False, "why": "unknown buffers"}, []
        return {"ok": True, "ids": ids}, [r.buffers[i].fd for i in ids]

    def _put(self, r: _Rank, m: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        nbytes, i = int(m["nbytes"]), int(m["id"])  # (raising here: the caller closes fds)
        if self.budget is None or self.released is not None:
            os.close(fds[0])
            return {"ok": False, "why": self.released or "no host-memory tier"}
        self._make_room(nbytes)
        held = self._ranks_held()
        if held + nbytes > self.budget:
            os.close(fds[0])
            why = (f"the host copy would hold {_gib(held + nbytes)}, over its budget of "
                   f"{_gib(self.budget)} (ciuic run --host-memory)")
            self._release(why)
            log.warning("ciuic run: host-memory copy released: %s; restarts restore "
                        "from the store", why)
            return {"ok": False, "why": why}
        old = r.buffers.pop(i, None)
        if old is not None:
            os.close(old.fd)
        r.buffers[i] = _Buffer(fds[0], nbytes)
        return {"ok": True}

    def _publish(self, r: _Rank, m: dict[str, Any]) -> dict[str, Any]:
        ids = [int(i) for i in m["ids"]]
        if self.released is not None or not all(i in r.buffers for i in ids):
            return {"ok": False, "why": self.released or "unknown buffers"}
        known = set(ids)
        leaves: list[list[Any]] = [[str(p), int(i), int(off), int(n)]
                                   for p, i, off, n in m.get("leaves", [])]
        chunks: list[list[Any]] = [[str(d), int(n), int(i), int(off)]
                                   for d, n, i, off in m.get("chunks", [])]
        spans = [(i, off, n) for _, i, off, n in leaves] + [(i, off, n) for _, n, i, off in chunks]
        for i, off, n in spans:
            if i not in known or off < 0 or n < 0 or off + n > r.buffers[i].nbytes:
                raise ValueError(f"bytes {off}..{off + n} of buffer {i} are not published")
        r.snapshot, r.step, r.ids = str(m["snapshot"]), int(m["step"]), ids
        r.leaves, r.chunks = leaves, chunks
        self.fetched.clear()  # what the restore before this snapshot fetched
        self._generation += 1
        self._published.notify_all()
        return {"ok": True}

    def _index(self) -> dict[str, Any]:
        """Every chunk the node's ranks published and its complete replicas hold: [digest,
        bytes, owner, buffer, offset] (a replica's owner is ``-1 - source node``), and the
        buffers they lie in: [owner, buffer, bytes]."""
        chunks: list[list[Any]] = []
        buffers: list[list[int]] = []
        for owner, x in sorted(self._ranks.items()):
            if not x.published() or not x.chunks:
                continue
            chunks += [[d, n, owner, i, off] for d, n, i, off in x.chunks]
            buffers += [[owner, i, x.buffers[i].nbytes] for i in sorted({c[2] for c in x.chunks})]
        theirs, segments = self._replica_index()
        return {"ok": True, "chunks": chunks + theirs, "buffers": buffers + segments}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
