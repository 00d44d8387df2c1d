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
import time
from dataclasses import dataclass, field
from typing import Any

from ciuic.format.chunks import HEADER_BYTES as SKEW
from ciuic.supervisor import beat
from ciuic.supervisor.channel import FDS_PER_MESSAGE, receive, send
from ciuic.supervisor.peers import ChunkHost, Node, PeerServer, Receiving, push
from ciuic.supervisor.replicas import Replicas

log = logging.getLogger("ciuic")
run_log = logging.getLogger("ciuic.run")  # what ciuic run prints


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


class Holder(ChunkHost):
    """The supervisor's end: serves attaches, keeps the buffers, and the heartbeat region;
    on a job of several nodes, serves this node's chunks to the others and keeps ``replicas``
    of the next nodes' (see :mod:`ciuic.supervisor.peers`)."""

    #: seconds without a publish before the node's chunks are sent to its replica holders
    #: (every local rank publishes after the same commit)
    SETTLE_S = 0.3

    def __init__(self, budget: int | None, replicas: int = 1) -> None:
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
        #: this node among the job's nodes (set by its ranks: ``listen`` and ``peers``)
        self.replica_count = replicas
        self._server: PeerServer | None = None
        self._token: str | None = None
        self._nodes: list[Node] = []
        self._me: int | None = None
        self.replicas = Replicas(self._room, self._lock)
        self._generation = 0  # bumped whenever what the ranks published changes
        self._published = threading.Condition(self._lock)
        self.pushed: list[tuple[int, int, int]] = []  # (node, chunks, bytes) of each replica
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
        with self._lock:
            self._published.notify_all()
        if self._server is not None:
            self._server.close()
        self.replicas.close()
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
                try:
                    reply, out = self._handle(message, fds)
                except Exception as e:  # a malformed request: answered, never fatal here
                    reply, out = {"ok": False, "why": f"{type(e).__name__}: {e}"}, []
                try:
                    send(conn, reply, out)
                except OSError:
                    return

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
                if self._server is None:
                    self._server = PeerServer(self, self._current_token)
                    threading.Thread(target=self._push_loop, name="ciuic-run-replicas",
                                     daemon=True).start()
                return {"ok": True, "port": self._server.port}, []
            if op == "peers":
                self._token = str(m["token"])
                self._me = int(m["me"])
                self._nodes = sorted({Node(int(g), str(h), int(p)) for g, h, p in m["nodes"]},
                                     key=lambda n: n.rank)
                self.replicas.keys = [bytes.fromhex(k) for k in m.get("keys", [])]
                return {"ok": True}, []
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
                "copy": copy, "why": self.released}

    def _fds(self, r: _Rank, m: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        ids = [int(i) for i in m["ids"]][:FDS_PER_MESSAGE]
        owner = m.get("owner")
        if owner is not None and int(owner) < 0:  # a replica of node -1 - owner
            rep = self.replicas.by_src.get(-1 - int(owner))
            segments = {} if rep is None else {p.segment.key: p.segment
                                               for p in rep.chunks.values()}
            if not set(ids) <= set(segments):
                return {"ok": False, "why": "that replica was replaced"}, []
            return {"ok": True, "ids": ids}, [segments[i].fd for i in ids]
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
        held = sum(b.nbytes for x in self._ranks.values() for b in x.buffers.values())
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
        for src, rep in sorted(self.replicas.by_src.items()):
            segments = {}
            for d, p in rep.chunks.items():
                segments[p.segment.key] = p.segment
                chunks.append([d, p.nbytes, -1 - src, p.segment.key, p.offset])
            buffers += [[-1 - src, k, seg.nbytes] for k, seg in segments.items()]
        return {"ok": True, "chunks": chunks, "buffers": buffers}

    # -- the chunk service (peers.ChunkHost) ----------------------------------------------

    def _current_token(self) -> str | None:
        return self._token

    def _room(self, nbytes: int) -> bool:
        if self.budget is None or self.released is not None:
            return False
        held = sum(b.nbytes for x in self._ranks.values() for b in x.buffers.values())
        return held + self.replicas.held() + nbytes <= self.budget

    def _own_chunks(self) -> dict[str, tuple[int, int, int]]:
        """digest -> (bytes, fd, offset in the fd) of every chunk the node's ranks published
        (call with the lock held)."""
        found: dict[str, tuple[int, int, int]] = {}
        for x in self._ranks.values():
            if x.published():
                for d, n, i, off in x.chunks:
                    found.setdefault(d, (n, x.buffers[i].fd, SKEW + off))
        return found

    def locate(self, d: str, n: int) -> tuple[int, int] | None:
        with self._lock:
            own = self._own_chunks().get(d)
            if own is not None and own[0] == n:
                return os.dup(own[1]), own[2]
            placed = self.replicas.locate(d)
            if placed is not None and placed.nbytes == n:
                return os.dup(placed.segment.fd), SKEW + placed.offset
        return None

    def servable(self) -> list[list[Any]]:
        with self._lock:
            out = {d: n for d, (n, _, _) in self._own_chunks().items()}
            for rep in self.replicas.by_src.values():
                for d, p in rep.chunks.items():
                    out.setdefault(d, p.nbytes)
        return [[d, n] for d, n in out.items()]

    def receive_replica(self, src: int, sid: str, entries: list[tuple[str, int]]
                        ) -> Receiving:
        return self.replicas.begin(src, sid, entries)

    def _push_loop(self) -> None:
        """Send each commit's chunks to the next ``replica_count`` nodes (in the order of
        their group ranks, wrapping around), in the background: a push the next snapshot
        overtakes is abandoned, and the next commit's push replaces it."""
        seen = -1
        while True:
            with self._lock:
                while not self._closed and (self._generation == seen or not self._ready()):
                    self._published.wait(1.0)
                if self._closed:
                    return
                gen = self._generation
            time.sleep(self.SETTLE_S)  # the other local ranks publish after the same commit
            with self._lock:
                if self._generation != gen:
                    continue  # still changing
                seen = gen
                targets = self._successors()
                steps = [x.step for x in self._ranks.values() if x.published()]
                chunks = [(d, n, os.dup(fd), off) for d, (n, fd, off)
                          in self._own_chunks().items()]
                token, me = self._token, self._me
            try:
                if chunks and token is not None and me is not None:
                    self._push_to(targets, token, me, max(s or 0 for s in steps), chunks, gen)
            finally:
                for _, _, fd, _ in chunks:
                    os.close(fd)

    def _ready(self) -> bool:
        return (self._token is not None and self._me is not None and len(self._nodes) > 1
                and self.replica_count > 0)

    def _successors(self) -> list[Node]:
        ranks = [n.rank for n in self._nodes]
        if self._me not in ranks:
            return []
        at = ranks.index(self._me)
        k = min(self.replica_count, len(ranks) - 1)
        return [self._nodes[(at + j) % len(ranks)] for j in range(1, k + 1)]

    def _push_to(self, targets: list[Node], token: str, me: int, step: int,
                 chunks: list[tuple[str, int, int, int]], gen: int) -> None:
        def still() -> bool:
            return self._generation == gen and not self._closed

        for node in targets:
            t0 = time.perf_counter()
            try:
                sent, nbytes = push(node, token, me, f"step-{step}", chunks, still)
            except Exception as e:  # the next commit sends again; training goes on
                run_log.info("ciuic run: the replica of this node's snapshot at step %d was "
                             "not sent to node %d (%s): %s", step, node.rank, node.host, e)
                continue
            self.pushed.append((node.rank, sent, nbytes))
            run_log.info("ciuic run: node %d (%s) holds a replica of this node's snapshot at "
                         "step %d (%d new chunks, %.1f MiB sent in %.2f s)", node.rank,
                         node.host, step, sent, nbytes / 2**20, time.perf_counter() - t0)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
