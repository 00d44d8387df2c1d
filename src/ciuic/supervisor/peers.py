"""Chunks between the nodes of a job: each node's ``ciuic run`` serves the chunks its memory
holds to the other nodes, and receives replicas of theirs.

A TCP connection carries the frames of :mod:`ciuic.supervisor.wire`. It opens with a handshake
in which each end proves to the other that it holds the job's token (rank 0 draws one at each
start; it reaches every rank through the job's collective and each node's ``ciuic run`` over
its local channel); every later frame, the chunks' bytes included, carries a tag under a key
of that connection. So only holders of this start's token read or write a node's memory, and
what they send cannot be altered, replayed or reordered on the way (docs/multinode.md, "What
the peer service trusts"). The service listens on the one address the node told the others.
Requests (:mod:`ciuic.supervisor.peer_messages`, each checked once on arrival; a malformed one
is answered with its fault):

- ``index``: every digest this node can serve (its ranks' published chunks, and the complete
  replicas it holds), with its length;
- ``get {d, n}``: the chunk's bytes (mapped from the memfd that holds it);
- ``put_begin {src, sid, entries}`` / ``put {d}`` + bytes / ``put_end``: a replica of node
  ``src``'s chunks, where ``src`` is the node the connection logged in as and another node of
  the job. Chunks the receiver's previous replica of ``src`` holds are not sent again; the
  replica's new bytes count against the receiver's ``--host-memory`` from ``put_begin`` on (one
  over it is refused with a reply); every chunk is checked against its digest on arrival, and
  the replica serves only once every entry arrived and checked.

Plaintext crosses the network (a sealed store's chunks too): tags make it tamper-evident, not
secret; the job's own network is trusted to keep it private as it is for its gradients.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ciuic.errors import BadRequest
from ciuic.errors import PeerError as PeerError  # (tests and nodes.py import it from here)
from ciuic.supervisor.peer_messages import (
    Get,
    Index,
    Ping,
    Put,
    PutBegin,
    PutEnd,
    chunk_list,
    parse_request,
)
from ciuic.supervisor.wire import TIMEOUT_S as TIMEOUT_S
from ciuic.supervisor.wire import Frame, Wire, client_login, mapped, server_login

log = logging.getLogger("ciuic")
#: seconds for a whole handshake, from the connection
HANDSHAKE_S = 10.0
#: seconds a logged-in connection may ask nothing before the server closes it
IDLE_S = 120.0
#: connections a node's chunk service holds at most, besides :data:`PER_NODE` for each node of
#: the job (every other node keeps one open for its pings, and opens one to read the index);
#: and of them not logged in yet (a thread and a few KiB each)
MAX_CONNECTIONS = 1024
PER_NODE = 4
MAX_HANDSHAKES = 256


@dataclass(frozen=True)
class Node:
    """One node of the job, as its ranks told each other: its group rank (torchrun's node
    rank), and where its ``ciuic run`` serves chunks."""

    rank: int
    host: str
    port: int


# -- the client ----------------------------------------------------------------------------


class PeerClient:
    """One authenticated connection to a node's chunk service (not thread-safe: one per
    thread). ``me``: this node's rank, which the server binds the replicas it sends to."""

    def __init__(self, node: Node, token: str, timeout: float = TIMEOUT_S,
                 me: int | None = None) -> None:
        self.node = node
        self._timeout = timeout
        self._sock = socket.create_connection((node.host, node.port), timeout=timeout)
        self._wire = Wire(self._sock)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_login(self._wire, token, me, min(3 * timeout, HANDSHAKE_S),
                         f"node {node.rank} ({node.host})")
        except BaseException:
            self._sock.close()
            raise

    def _reply(self, chunk: bool = False) -> Frame:
        """The next reply; one that carries a payload it should not (only a ``get`` that
        succeeds does) is read past and raises."""
        frame = self._wire.recv(self._timeout)
        if frame.n and not (chunk and frame.header.get("ok") is True):
            self._wire.recv_payload(None)
            raise PeerError(f"node {self.node.rank}: a reply with bytes it should not have")
        return frame

    def call(self, header: dict[str, Any], payload: bytes | memoryview = b""
             ) -> dict[str, Any]:
        self._wire.send(header, payload, self._timeout)
        reply = self._reply().header
        if reply.get("ok") is not True:
            raise PeerError(f"node {self.node.rank}: {str(reply.get('why'))[:500]}")
        return reply

    def ping(self) -> dict[str, Any]:
        """The node's status (:meth:`ChunkHost.status`)."""
        return self.call(Ping().to_json())

    def index(self) -> dict[str, int]:
        """digest -> bytes of every chunk the node serves."""
        return dict(chunk_list(self.call(Index().to_json()).get("chunks"), "an index"))

    def get(self, d: str, dest: memoryview) -> bool:
        """Chunk ``d`` into ``dest`` (its length); False where the node no longer holds it."""
        self._wire.send(Get(d, len(dest)).to_json(), timeout=self._timeout)
        frame = self._reply(chunk=True)
        if frame.header.get("ok") is not True:
            return False
        if frame.n != len(dest):
            raise PeerError(f"node {self.node.rank} sent {frame.n} bytes for a chunk of "
                            f"{len(dest)}")
        self._wire.recv_payload(dest)
        return True

    def put_fd(self, d: str, fd: int, offset: int, n: int) -> dict[str, Any]:
        """Chunk ``d``: ``n`` bytes of ``fd`` from ``offset``; the node's reply (not checked)."""
        with mapped(fd, offset, n) as view:
            self._wire.send(Put(d, n).to_json(), view, self._timeout)
        return self._reply().header

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


# -- the server ----------------------------------------------------------------------------


class ChunkHost:
    """What a node's chunk service serves and stores (the supervisor's :class:`Holder`)."""

    def locate(self, d: str, n: int) -> tuple[int, int] | None:  # pragma: no cover - protocol
        """(fd, offset in it) of a servable chunk, or None; the caller closes the fd."""
        raise NotImplementedError

    def servable(self) -> list[list[Any]]:  # pragma: no cover - protocol
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        """What a ping answers besides ok: the node's last cause of a stop, and its age."""
        return {}

    def receive_replica(self, src: int, sid: str, entries: list[tuple[str, int]]
                        ) -> Receiving:  # pragma: no cover - protocol
        """A replica of node ``src`` begins; ValueError (answered as a refusal): ``src`` is
        not another node of the job, or the replica does not fit the memory budget."""
        raise NotImplementedError


class Receiving:
    """A replica in transit (made by :meth:`ChunkHost.receive_replica`)."""

    missing: list[tuple[str, int]]

    def buffer(self, d: str, n: int) -> memoryview:  # pragma: no cover - protocol
        """Where chunk ``d`` of ``n`` bytes is to be received; ValueError (answered as a
        refusal, the replica goes on): not one of the replica's missing chunks, or the replica
        was dropped to make room."""
        raise NotImplementedError

    def arrived(self, d: str, view: memoryview) -> None:  # pragma: no cover - protocol
        """Check the chunk against its digest (raises on a mismatch) and note it."""
        raise NotImplementedError

    def complete(self) -> None:  # pragma: no cover - protocol
        """Every entry arrived: the replica replaces the previous one of its source
        (ValueError where some did not, or the replica was dropped to make room)."""
        raise NotImplementedError

    def abandon(self) -> None:  # pragma: no cover - protocol
        raise NotImplementedError


class PeerServer:
    """The node's chunk service: a listening socket and a thread per connection, at most
    ``max_connections`` of them and ``max_handshakes`` not logged in yet (a connection past
    either is closed at once); a handshake has ``handshake_s`` in all, a logged-in connection
    that asks nothing for ``idle_s`` is closed.

    ``bind`` None: the port is reserved on every address and nothing is served until
    :meth:`serve_on` names the one address the other nodes were told."""

    def __init__(self, host: ChunkHost, token: Callable[[], str | None],
                 bind: str | None = None, port: int = 0, *,
                 handshake_s: float = HANDSHAKE_S, idle_s: float = IDLE_S,
                 max_connections: int = MAX_CONNECTIONS,
                 max_handshakes: int = MAX_HANDSHAKES) -> None:
        self._host = host
        self._token = token
        self._handshake_s, self._idle_s = handshake_s, idle_s
        #: (the job's nodes known, :meth:`serve_on` raises it by :data:`PER_NODE` each)
        self.max_connections = max_connections
        self._max_login = max_handshakes
        self._closed = False
        self._lock = threading.Lock()
        self._conns = self._logging_in = 0
        self._live: set[socket.socket] = set()
        #: connections closed at once for the limits; chunks and bytes served to other nodes
        #: (``get``), since the server started
        self.turned_away = 0
        self.served = 0
        self.served_bytes = 0
        self.address: str | None = None
        self._sock: socket.socket | None = None
        if bind is None:  # bound, not listening: a connection is refused by the kernel
            self._reserved: socket.socket | None = socket.socket()
            self._reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._reserved.bind(("0.0.0.0", port))
            self.port = int(self._reserved.getsockname()[1])
        else:
            self._reserved = None
            self.port = port
            self.serve_on(bind)

    def serve_on(self, address: str) -> None:
        """Listen on ``address`` (this node's, as the other nodes know it) and the port, only
        (raises OSError where this node has no such address; nothing is served then)."""
        if address == self.address and self._sock is not None:
            return
        old, self._sock, self.address = self._sock, None, None
        if old is not None:
            _shut(old)
        try:
            sock = socket.create_server((address, self.port))
        except OSError:
            if self._reserved is None:
                raise
            _shut(self._reserved)  # a wildcard reservation may keep the port: give it up
            self._reserved = None
            sock = socket.create_server((address, self.port))
        if self._reserved is not None:
            _shut(self._reserved)
            self._reserved = None
        self.port = int(sock.getsockname()[1])
        self._sock, self.address = sock, address
        threading.Thread(target=self._accept, args=(sock,), name="ciuic-peers",
                         daemon=True).start()

    def close(self) -> None:
        """Stop listening, and end every connection."""
        self._closed = True
        for sock in (self._sock, self._reserved):
            if sock is not None:
                _shut(sock)
        with self._lock:
            live = list(self._live)
        for conn in live:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept(self, sock: socket.socket) -> None:
        while not self._closed:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with self._lock:
                full = self._conns >= self.max_connections or self._logging_in >= self._max_login
                if full:
                    self.turned_away += 1
                else:
                    self._conns += 1
                    self._logging_in += 1
                    self._live.add(conn)
            if full:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="ciuic-peer",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        receiving: Receiving | None = None
        logging_in = True
        wire = Wire(conn)
        with conn:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                node = server_login(wire, self._token(), self._handshake_s)
                with self._lock:
                    self._logging_in -= 1
                    logging_in = False
                while not self._closed:
                    frame = wire.recv(self._idle_s)
                    receiving = self._one(wire, node, frame, receiving)
            except (OSError, PeerError) as e:
                log.debug("a peer connection ended: %s", e)
            finally:
                if receiving is not None:
                    receiving.abandon()
                with self._lock:
                    self._conns -= 1
                    self._logging_in -= logging_in
                    self._live.discard(conn)

    def _one(self, wire: Wire, node: int | None, frame: Frame, receiving: Receiving | None
             ) -> Receiving | None:
        try:
            req = parse_request(frame.header, frame.n)
        except BadRequest as e:
            if frame.n:
                wire.recv_payload(None)
            wire.send({"ok": False, "why": str(e)})
            return receiving
        if isinstance(req, Ping):
            wire.send({"ok": True, **self._host.status()})
        elif isinstance(req, Index):
            wire.send({"ok": True, "chunks": self._host.servable()})
        elif isinstance(req, Get):
            self._get(wire, req)
        elif isinstance(req, PutBegin):
            if receiving is not None:
                receiving.abandon()
                receiving = None
            if req.src != node:
                wire.send({"ok": False, "why": f"a replica of node {req.src} on a connection "
                           f"of node {node}"})
                return None
            try:
                receiving = self._host.receive_replica(req.src, req.sid, list(req.entries))
            except ValueError as e:
                wire.send({"ok": False, "why": str(e)})
                return None
            wire.send({"ok": True, "missing": receiving.missing})
        elif isinstance(req, Put):
            return self._put(wire, req, receiving)
        else:
            if receiving is None:
                wire.send({"ok": False, "why": "put_end before put_begin"})
                return None
            try:
                receiving.complete()
            except ValueError as e:
                receiving.abandon()
                wire.send({"ok": False, "why": str(e)})
                return None
            wire.send({"ok": True})
            return None
        return receiving

    def _get(self, wire: Wire, req: Get) -> None:
        at = self._host.locate(req.d, req.n)
        if at is None:
            wire.send({"ok": False, "why": "not held"})
            return
        try:  # a descriptor of its own (the holder may close its buffer meanwhile)
            with mapped(at[0], at[1], req.n) as view:
                wire.send({"ok": True}, view)
        except ValueError:
            wire.send({"ok": False, "why": "not held"})
            return
        finally:
            os.close(at[0])
        with self._lock:
            self.served, self.served_bytes = self.served + 1, self.served_bytes + req.n

    def _put(self, wire: Wire, req: Put, receiving: Receiving | None) -> Receiving | None:
        try:
            if receiving is None:
                raise ValueError("put before put_begin")
            view = receiving.buffer(req.d, req.n)
        except ValueError as e:
            wire.recv_payload(None)
            wire.send({"ok": False, "why": str(e)})
            return receiving
        try:
            wire.recv_payload(view)
            receiving.arrived(req.d, view)
        except ValueError as e:
            receiving.abandon()
            wire.send({"ok": False, "why": str(e)})
            return None
        finally:
            view.release()
        wire.send({"ok": True})
        return receiving


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


# -- a rank's reads from other nodes ---------------------------------------------------------


class PeerReader:
    """Chunks from the other nodes' memory, for one restore: each node's index is asked once
    (on the first chunk this node lacks), then each reading thread keeps a connection per
    node. A node that cannot be reached, or fails a read, is left out from then on (its chunks
    come from the store)."""

    def __init__(self, nodes: list[Node], me: int, token: str) -> None:
        self._nodes = [n for n in nodes if n.rank != me]
        self._token = token
        self._where: dict[str, Node] | None = None
        self._failed: set[int] = set()  # node ranks left out
        self._lock = threading.Lock()
        self._local = threading.local()
        self._clients: list[PeerClient] = []

    def _index(self) -> dict[str, Node]:
        with self._lock:
            if self._where is None:
                where: dict[str, Node] = {}
                for node in self._nodes:
                    try:
                        client = self._client(node)
                        for d in client.index():
                            where.setdefault(d, node)
                    except (OSError, PeerError) as e:
                        self._failed.add(node.rank)
                        log.warning("the memory of node %d (%s:%d) cannot be read (%s): its "
                                    "chunks come from the store", node.rank, node.host,
                                    node.port, e)
                self._where = where
            return self._where

    def _client(self, node: Node) -> PeerClient:
        """This thread's connection to ``node``."""
        clients: dict[int, PeerClient] = self._local.__dict__.setdefault("clients", {})
        client = clients.get(node.rank)
        if client is None:
            client = clients[node.rank] = PeerClient(node, self._token)
            self._clients.append(client)
        return client

    def _drop(self, node: Node) -> None:
        clients: dict[int, PeerClient] = self._local.__dict__.get("clients", {})
        broken = clients.pop(node.rank, None)
        if broken is not None:
            broken.close()

    def holds(self, d: str) -> bool:
        node = self._index().get(d)
        return node is not None and node.rank not in self._failed

    def read(self, d: str, dest: memoryview) -> bool:
        """Chunk ``d`` into ``dest`` from the node that holds it; False where none could
        give it (the caller reads the store). The caller checks the bytes."""
        node = self._index().get(d)
        while node is not None and node.rank not in self._failed:
            kept = node.rank in self._local.__dict__.get("clients", {})
            try:
                return self._client(node).get(d, dest)
            except (OSError, PeerError) as e:
                self._drop(node)
                if kept and not isinstance(e, PeerError):
                    continue  # a connection kept from before (the node closes idle ones)
                log.warning("reading a chunk from node %d (%s) failed (%s): its chunks come "
                            "from the store", node.rank, node.host, e)
                with self._lock:
                    self._failed.add(node.rank)
        return False

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()


def push(node: Node, token: str, src: int, sid: str,
         chunks: Iterator[tuple[str, int, int, int]] | list[tuple[str, int, int, int]],
         still: Callable[[], bool]) -> tuple[int, int]:
    """Send node ``node`` a replica of this node's chunks (digest, bytes, fd, offset), as
    snapshot ``sid`` of source ``src`` (this node's rank); ``still()`` False abandons it (the
    chunks are changing). Returns (chunks sent, bytes sent)."""
    entries = list(chunks)
    by_digest = {d: (n, fd, off) for d, n, fd, off in entries}
    client = PeerClient(node, token, me=src)
    sent = nbytes = 0
    try:
        begin = PutBegin(src, sid, tuple((d, n) for d, (n, _, _) in by_digest.items()))
        missing = chunk_list(client.call(begin.to_json()).get("missing"), "missing")
        for d, n in missing:
            if not still():
                raise PeerError("the chunks changed while they were sent")
            if d not in by_digest or by_digest[d][0] != n:
                raise PeerError(f"node {node.rank} asked for chunk {d[:12]}, not sent")
            _, fd, off = by_digest[d]
            reply = client.put_fd(d, fd, off, n)
            if reply.get("ok") is not True:  # a chunk staged anew while it was sent: torn
                raise PeerError("the chunks changed while they were sent" if not still()
                                else f"node {node.rank}: {str(reply.get('why'))[:500]}")
            sent, nbytes = sent + 1, nbytes + n
        if not still():
            raise PeerError("the chunks changed while they were sent")
        client.call(PutEnd().to_json())
    finally:
        client.close()
    return sent, nbytes
