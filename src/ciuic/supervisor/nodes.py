"""A node's side of a job of several nodes, for the supervisor's :class:`~ciuic.supervisor.
holder.Holder`: its chunk service for the other nodes (:mod:`ciuic.supervisor.peers`), the
replicas it sends after each commit and keeps of theirs (:mod:`ciuic.supervisor.replicas`), and
its pings, which tell which nodes do not answer, why another node's workers stopped, and how
long another node's workers have been silent (docs/architecture.md, "Many nodes").
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
from typing import Any

from ciuic.format.chunks import HEADER_BYTES as SKEW
from ciuic.supervisor.fetched import Fetched
from ciuic.supervisor.peers import (
    MAX_CONNECTIONS,
    PER_NODE,
    ChunkHost,
    Node,
    PeerClient,
    PeerError,
    PeerReader,
    PeerServer,
    Receiving,
    push,
)
from ciuic.supervisor.replicas import Replicas, said_level

run_log = logging.getLogger("ciuic.run")  # what ciuic run prints


class NodeService(ChunkHost):
    """The holder's part that talks to other nodes (a mixin: it shares the holder's lock, its
    ranks and its budget)."""

    #: seconds without a publish before the node's chunks are sent to its replica holders,
    #: when not every local rank published the same snapshot yet
    SETTLE_S = 0.3
    _lock: threading.Lock
    _ranks: dict[int, Any]
    _closed: bool
    budget: int | None
    released: str | None

    def _init_nodes(self, replicas: int, peer_timeout_s: float) -> None:
        #: this node among the job's nodes (set by its ranks: ``listen`` and ``peers``)
        self.replica_count = replicas
        self._server: PeerServer | None = None
        self._token: str | None = None
        self._nodes: list[Node] = []
        self._me: int | None = None
        self.replicas = Replicas(self._room, self._lock)
        self._told: dict[int, bool] = {}  # node -> whether its replica was sent, as last said
        #: chunks this node's ranks read from other nodes, fetched once for all of them
        self.fetched = Fetched(self._lock, self._room)
        self._reader: PeerReader | None = None  # this start's reads of other nodes' memory
        self._generation = 0  # bumped whenever what the ranks published changes
        self._published = threading.Condition(self._lock)
        #: (node, chunks, bytes) of the last replicas sent (bounded: a supervisor lives long)
        self.pushed: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=64)
        self.peer_timeout_s = peer_timeout_s
        #: node rank -> (its node, what is wrong, since when: monotonic) for each other node
        #: whose ciuic run does not answer now
        self.trouble: dict[int, tuple[Node, str, float]] = {}
        #: the cause this node's workers last stopped for (set by the agent), and when
        self.cause: tuple[str, float] | None = None
        #: node rank -> (its node, the cause its workers last stopped for, when: monotonic)
        self.peer_causes: dict[int, tuple[Node, str, float]] = {}
        #: what the agent tells the workers torchrun restarts within one start (the next
        #: generation): number, cause, stopped_at, pids; in each attach reply (None: nothing)
        self.restart: dict[str, Any] | None = None
        #: how long this node's most silent worker has made no step() (seconds, as of a
        #: monotonic time), and when this node last stopped a hung worker: set by the agent
        self.silence: tuple[float, float] = (0.0, time.monotonic())
        self.stopped_hang: float | None = None
        #: node rank -> (its most silent worker's silence, its last hang stop's age or None,
        #: when that was said: monotonic) from each node's last ping answer
        self.peer_hangs: dict[int, tuple[float, float | None, float]] = {}
        self._pinging = False

    def _listen(self) -> dict[str, Any]:
        """Serve this node's chunks (once), and send replicas after each commit."""
        if self._server is None:
            self._server = PeerServer(self, self._current_token)
            threading.Thread(target=self._push_loop, name="ciuic-run-replicas",
                             daemon=True).start()
        return {"ok": True, "port": self._server.port}

    def _join(self, m: dict[str, Any]) -> dict[str, Any]:
        """The job's nodes, this one's group rank and this start's token, from a rank."""
        token, me = str(m["token"]), int(m["me"])
        nodes = sorted({Node(int(g), str(h), int(p)) for g, h, p in m["nodes"]},
                       key=lambda n: n.rank)
        if (token, me, nodes) != (self._token, self._me, self._nodes):
            # a new start (the lock is held): its reads use its token
            if self._reader is not None:
                self._reader.close()
            self._reader = None
            self.fetched.clear()
        self._token, self._me, self._nodes = token, me, nodes
        self._serve_on(me, nodes)
        self.replicas.keys = [bytes.fromhex(k) for k in m.get("keys", [])]
        if not self._pinging and len(self._nodes) > 1:
            self._pinging = True
            threading.Thread(target=self._ping_loop, name="ciuic-run-ping",
                             daemon=True).start()
        return {"ok": True}

    def _serve_on(self, me: int, nodes: list[Node]) -> None:
        """Serve this node's chunks on the one address its ranks told the other nodes."""
        mine = [n for n in nodes if n.rank == me]
        if self._server is None or not mine or mine[0].port != self._server.port:
            return
        self._server.max_connections = MAX_CONNECTIONS + PER_NODE * len(nodes)
        try:
            self._server.serve_on(mine[0].host)
        except OSError as e:
            run_log.warning("ciuic run: this node's memory cannot be served to the other nodes "
                            "on %s:%d (%s): their restores read the store", mine[0].host,
                            mine[0].port, e)

    def _close_nodes(self) -> None:
        with self._lock:
            self._published.notify_all()
            self.fetched.clear()
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        if self._server is not None:
            self._server.close()
        self.replicas.close()

    def _fetch(self, m: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """A rank's ``fetch {d, n}``: the descriptor of a chunk this node lacks, fetched from
        the node that holds it once for all of this node's ranks (:mod:`~ciuic.supervisor.
        fetched`); ``fetched``: whether this request made it cross the network. The caller
        closes the descriptor once sent."""
        d, n = str(m["d"]), int(m["n"])
        if n <= 0:
            raise ValueError(f"a chunk of {n} bytes")
        with self._lock:
            reader = self._reader
            if reader is None and self._token is not None and self._me is not None \
                    and len(self._nodes) > 1:
                reader = self._reader = PeerReader(self._nodes, self._me, self._token)
        if reader is None:
            return {"ok": False, "why": "this node knows no other nodes"}, []
        got = self.fetched.get(d, n, reader.read)
        if got is None:
            return {"ok": False, "why": "no other node holds it"}, []
        return {"ok": True, "fetched": got[1]}, [got[0]]

    def _replica_index(self) -> tuple[list[list[Any]], list[list[int]]]:
        """The complete replicas' chunks as the ranks' index lists them: [digest, bytes,
        ``-1 - source node``, segment, offset], and their segments (call with the lock)."""
        chunks: list[list[Any]] = []
        buffers: list[list[int]] = []
        for src, rep in sorted(self.replicas.by_src.items()):
            segments = {}
            for d, p in rep.chunks.items():
                segments[p.segment.key] = p.segment
                chunks.append([d, p.nbytes, -1 - src, p.segment.key, p.offset])
            buffers += [[-1 - src, k, seg.nbytes] for k, seg in segments.items()]
        return chunks, buffers

    def _replica_fds(self, owner: int, ids: list[int]) -> tuple[dict[str, Any], list[int]]:
        rep = self.replicas.by_src.get(-1 - owner)
        segments = {} if rep is None else {p.segment.key: p.segment for p in rep.chunks.values()}
        if not set(ids) <= set(segments):
            return {"ok": False, "why": "that replica was replaced"}, []
        return {"ok": True, "ids": ids}, [segments[i].fd for i in ids]

    def _current_token(self) -> str | None:
        return self._token

    def _ranks_held(self) -> int:
        """Bytes of the node's ranks' buffers (call with the lock held)."""
        return sum(b.nbytes for x in self._ranks.values() for b in x.buffers.values())

    def _room(self, nbytes: int) -> bool:
        if self.budget is None or self.released is not None:
            return False
        return (self._ranks_held() + self.replicas.held() + self.fetched.held() + nbytes
                <= self.budget)

    def _make_room(self, nbytes: int) -> None:
        """Before a rank's buffer of ``nbytes``: drop the other nodes' replicas when they
        keep it from fitting ``--host-memory`` (this node's own copy comes first; call with
        the lock held)."""
        assert self.budget is not None
        if self._ranks_held() + self.replicas.held() + self.fetched.held() + nbytes \
                > self.budget:
            self.fetched.clear()  # they served a restore: the node's own copy comes first
        theirs = self.replicas.held()
        if theirs and self._ranks_held() + theirs + nbytes > self.budget:
            self.replicas.clear()
            run_log.info("ciuic run: the replicas of other nodes' snapshots (%.1f MiB) were "
                         "dropped to keep this node's own copy within --host-memory; a lost "
                         "node restores from the store until the next replicas arrive",
                         theirs / 2**20)

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

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        silent, at = self.silence
        out: dict[str, Any] = {"silent": silent + now - at, "stopped_hang":
                               None if self.stopped_hang is None else now - self.stopped_hang}
        if self.cause is not None:
            out["cause"] = [self.cause[0], now - self.cause[1]]
        return out

    def other_hangs(self, now: float) -> tuple[float, float | None]:
        """The longest silence of another node's workers (as of ``now``), and how long ago
        another node last stopped a hung worker (None: none did), from their ping answers of
        the last 5 s."""
        silent, stopped = 0.0, None
        for s, age, at in self.peer_hangs.values():
            if now - at > 5.0:
                continue
            silent = max(silent, s + now - at)
            if age is not None:
                stopped = min(stopped if stopped is not None else age + now - at,
                              age + now - at)
        return silent, stopped

    def servable(self) -> list[list[Any]]:
        with self._lock:
            out = {d: n for d, (n, _, _) in self._own_chunks().items()}
            for rep in self.replicas.by_src.values():
                for d, p in rep.chunks.items():
                    out.setdefault(d, p.nbytes)
        return [[d, n] for d, n in out.items()]

    def receive_replica(self, src: int, sid: str, entries: list[tuple[str, int]]
                        ) -> Receiving:
        with self._lock:
            others = {n.rank for n in self._nodes if n.rank != self._me}
        if src not in others:
            raise ValueError(f"node {src} is not another node of this job (they are "
                             f"{sorted(others)})")
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
                settled = self._settled()
            if not settled:  # another local rank may still publish after the same commit
                time.sleep(self.SETTLE_S)
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

    def _ping_loop(self) -> None:
        """Ask every other node's ``ciuic run`` once a second whether it is there; note in
        :attr:`trouble` which are not (gone: refused or closed, the node is down or its ciuic
        run was killed; unreachable: no answer, a network fault or a node that hangs)."""
        clients: dict[int, PeerClient] = {}
        while not self._closed:
            with self._lock:
                nodes = [n for n in self._nodes if n.rank != self._me]
                token = self._token
            for node in nodes:
                client = clients.get(node.rank)
                try:
                    if client is None or client.node != node:
                        client = clients[node.rank] = PeerClient(node, token or "", timeout=1.0)
                    answer = client.ping()
                    said = answer.get("cause")
                    self.trouble.pop(node.rank, None)
                    age = answer.get("stopped_hang")
                    self.peer_hangs[node.rank] = (float(answer.get("silent") or 0.0),
                                                  None if age is None else float(age),
                                                  time.monotonic())
                    if said:
                        self.peer_causes[node.rank] = (node, str(said[0]),
                                                       time.monotonic() - float(said[1]))
                    continue
                except PeerError:  # another start's token: it is there
                    self.trouble.pop(node.rank, None)
                except TimeoutError as e:
                    self._trouble(node, f"unreachable ({e or 'no answer'})")
                except OSError as e:
                    unreachable = e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)
                    self._trouble(node, "unreachable (network fault or node down)" if
                                  unreachable else "its ciuic run is gone (the node is down, "
                                  "or ciuic run was killed)")
                dropped = clients.pop(node.rank, None)
                if dropped is not None:
                    dropped.close()
            time.sleep(1.0)
        for client in clients.values():
            client.close()

    def _trouble(self, node: Node, why: str) -> None:
        was = self.trouble.get(node.rank)
        self.trouble[node.rank] = (node, why, was[2] if was else time.monotonic())

    def peered(self) -> bool:
        """Whether this node knows other nodes of its job."""
        return len(self._nodes) > 1

    def _settled(self) -> bool:
        """Whether every rank of the node that holds buffers published the same snapshot."""
        held = [x.snapshot for x in self._ranks.values() if x.buffers]
        return bool(held) and held[0] is not None and len(set(held)) == 1

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
                # (a newer snapshot overtook it: no change to say)
                run_log.log(said_level(self._told, node.rank, False) if still() else
                            logging.DEBUG, "ciuic run: the replica of this node's snapshot at "
                            "step %d was not sent to node %d (%s): %s", step, node.rank,
                            node.host, e)
                continue
            self.pushed.append((node.rank, sent, nbytes))
            level = said_level(self._told, node.rank, True)
            run_log.log(level, "ciuic run: node %d (%s) holds a replica of this node's "
                        "snapshot at step %d (%d new chunks, %.1f MiB sent in %.2f s)%s",
                        node.rank, node.host, step, sent, nbytes / 2**20,
                        time.perf_counter() - t0, "; the next ones are said only if one is "
                        "not sent" if level == logging.INFO else "")


