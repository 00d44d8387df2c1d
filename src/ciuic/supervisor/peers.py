"""Chunks between the nodes of a job: each node's ``ciuic run`` serves the chunks its memory
holds to the other nodes, and receives replicas of theirs.

A TCP connection carries frames of ``u32 length | JSON header`` followed, for a header with
``n``, by ``n`` raw bytes. The server speaks first: a random challenge; the client answers with
the HMAC-SHA256 of it under the job's token (which rank 0 draws at each start and every rank
hands its supervisor over the local channel), so only the job's own nodes read or write a
node's memory. Requests:

- ``index``: every digest this node can serve (its ranks' published chunks, and the complete
  replicas it holds), with its length;
- ``get {d, n}``: the chunk's bytes (``sendfile`` from the memfd that holds it);
- ``put_begin {src, sid, entries}`` / ``put {d, n}`` + bytes / ``put_end``: a replica of node
  ``src``'s chunks. Chunks the receiver's previous replica of ``src`` holds are not sent again;
  every chunk is checked against its digest on arrival, and the replica serves only once every
  entry arrived and checked.

Plaintext crosses the network (a sealed store's chunks too): the job's own network is trusted
as it is for its gradients.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ciuic.errors import PeerError as PeerError  # (tests and nodes.py import it from here)

log = logging.getLogger("ciuic")
_LEN = struct.Struct("!I")
_MAX_HEADER = 1 << 28
TIMEOUT_S = 30.0


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        view = view[n:]


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    data = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data + payload)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    size = bytearray(_LEN.size)
    _recv_exact(sock, memoryview(size))
    (n,) = _LEN.unpack(size)
    if n > _MAX_HEADER:
        raise PeerError(f"a frame header of {n} bytes")
    data = bytearray(n)
    _recv_exact(sock, memoryview(data))
    header = json.loads(data)
    if not isinstance(header, dict):
        raise PeerError("a frame header that is not an object")
    return header


def _mac(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


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
    thread)."""

    def __init__(self, node: Node, token: str, timeout: float = TIMEOUT_S) -> None:
        self.node = node
        self._sock = socket.create_connection((node.host, node.port), timeout=timeout)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = recv_frame(self._sock).get("nonce")
            send_frame(self._sock, {"op": "hello", "mac": _mac(token, str(nonce))})
            if not recv_frame(self._sock).get("ok"):
                raise PeerError(f"node {node.rank} ({node.host}) refused this job's token")
        except BaseException:
            self._sock.close()
            raise

    def call(self, header: dict[str, Any], payload: bytes = b"") -> dict[str, Any]:
        send_frame(self._sock, header, payload)
        reply = recv_frame(self._sock)
        if not reply.get("ok"):
            raise PeerError(f"node {self.node.rank}: {reply.get('why', 'refused')}")
        return reply

    def ping(self) -> dict[str, Any]:
        """The node's status (:meth:`ChunkHost.status`)."""
        return self.call({"op": "ping"})

    def index(self) -> dict[str, int]:
        """digest -> bytes of every chunk the node serves."""
        return {str(d): int(n) for d, n in self.call({"op": "index"})["chunks"]}

    def get(self, d: str, dest: memoryview) -> bool:
        """Chunk ``d`` into ``dest`` (its length); False where the node no longer holds it."""
        send_frame(self._sock, {"op": "get", "d": d, "n": len(dest)})
        reply = recv_frame(self._sock)
        if not reply.get("ok"):
            return False
        _recv_exact(self._sock, dest)
        return True

    def send_fd(self, header: dict[str, Any], fd: int, offset: int, n: int) -> None:
        """A frame whose ``n`` payload bytes are read from ``fd`` at ``offset``, by the
        kernel."""
        data = json.dumps({**header, "n": n}, separators=(",", ":")).encode()
        self._sock.sendall(_LEN.pack(len(data)) + data)
        _sendfile(self._sock, fd, offset, n)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


def _sendfile(sock: socket.socket, fd: int, offset: int, n: int) -> None:
    """``n`` bytes of ``fd`` from ``offset`` to ``sock``, by the kernel. A socket with a timeout
    is non-blocking underneath: a full send buffer is waited for, up to that timeout."""
    timeout = sock.gettimeout()
    while n:
        try:
            sent = os.sendfile(sock.fileno(), fd, offset, n)
        except BlockingIOError:
            if not select.select([], [sock], [], timeout)[1]:
                raise TimeoutError(f"the peer took no data for {timeout} s") from None
            continue
        if sent == 0:
            raise ConnectionError("the peer closed the connection")
        offset, n = offset + sent, n - sent


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
        raise NotImplementedError


class Receiving:
    """A replica in transit (made by :meth:`ChunkHost.receive_replica`)."""

    missing: list[tuple[str, int]]

    def buffer(self, d: str, n: int) -> memoryview:  # pragma: no cover - protocol
        """Where chunk ``d`` of ``n`` bytes is to be received."""
        raise NotImplementedError

    def arrived(self, d: str, view: memoryview) -> None:  # pragma: no cover - protocol
        """Check the chunk against its digest (raises on a mismatch) and note it."""
        raise NotImplementedError

    def complete(self) -> None:  # pragma: no cover - protocol
        """Every entry arrived: the replica replaces the previous one of its source."""
        raise NotImplementedError

    def abandon(self) -> None:  # pragma: no cover - protocol
        raise NotImplementedError


class PeerServer:
    """The node's chunk service: a listening socket and a thread per connection."""

    def __init__(self, host: ChunkHost, token: Callable[[], str | None],
                 bind: str = "0.0.0.0", port: int = 0) -> None:
        self._host = host
        self._token = token
        self._sock = socket.create_server((bind, port), reuse_port=False)
        self.port = int(self._sock.getsockname()[1])
        self._closed = False
        #: chunks and bytes served to other nodes (``get``), since the server started
        self.served = 0
        self.served_bytes = 0
        self._count = threading.Lock()
        threading.Thread(target=self._accept, name="ciuic-peers", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="ciuic-peer",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        receiving: Receiving | None = None
        with conn:
            try:
                conn.settimeout(TIMEOUT_S)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nonce = secrets.token_hex(16)
                send_frame(conn, {"nonce": nonce})
                hello = recv_frame(conn)
                token = self._token()
                if token is None or not hmac.compare_digest(str(hello.get("mac")),
                                                            _mac(token, nonce)):
                    send_frame(conn, {"ok": False, "why": "not this job's token"})
                    return
                send_frame(conn, {"ok": True})
                conn.settimeout(None)  # an idle connection waits for the next restore
                while True:
                    receiving = self._one(conn, recv_frame(conn), receiving)
            except (OSError, ValueError, PeerError, ConnectionError) as e:
                log.debug("a peer connection ended: %s", e)
            finally:
                if receiving is not None:
                    receiving.abandon()

    def _one(self, conn: socket.socket, m: dict[str, Any], receiving: Receiving | None
             ) -> Receiving | None:
        op = m.get("op")
        if op == "ping":
            send_frame(conn, {"ok": True, **self._host.status()})
        elif op == "index":
            send_frame(conn, {"ok": True, "chunks": self._host.servable()})
        elif op == "get":
            d, n = str(m["d"]), int(m["n"])
            at = self._host.locate(d, n)
            if at is None:
                send_frame(conn, {"ok": False, "why": "not held"})
            else:  # a descriptor of its own (the holder may close its buffer meanwhile)
                try:
                    send_frame(conn, {"ok": True})
                    _sendfile(conn, at[0], at[1], n)
                finally:
                    os.close(at[0])
                with self._count:
                    self.served, self.served_bytes = self.served + 1, self.served_bytes + n
        elif op == "put_begin":
            if receiving is not None:
                receiving.abandon()
            entries = [(str(d), int(n)) for d, n in m["entries"]]
            receiving = self._host.receive_replica(int(m["src"]), str(m["sid"]), entries)
            send_frame(conn, {"ok": True, "missing": receiving.missing})
        elif op == "put":
            if receiving is None:
                raise PeerError("put before put_begin")
            d, n = str(m["d"]), int(m["n"])
            view = receiving.buffer(d, n)
            try:
                _recv_exact(conn, view)
                receiving.arrived(d, view)
            except ValueError as e:
                send_frame(conn, {"ok": False, "why": str(e)})
                view.release()
                receiving.abandon()
                return None
            view.release()
            send_frame(conn, {"ok": True})
        elif op == "put_end":
            if receiving is None:
                raise PeerError("put_end before put_begin")
            receiving.complete()
            send_frame(conn, {"ok": True})
            return None
        else:
            raise PeerError(f"unknown request {op!r}")
        return receiving


# -- a rank's reads from other nodes ---------------------------------------------------------


class PeerReader:
    """Chunks from the other nodes' memory, for one restore: each node's index is asked once
    (on the first chunk this node lacks), then each reading thread keeps a connection per
    node. A node that cannot be reached is left out (its chunks come from the store)."""

    def __init__(self, nodes: list[Node], me: int, token: str) -> None:
        self._nodes = [n for n in nodes if n.rank != me]
        self._token = token
        self._where: dict[str, Node] | None = None
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
                    except (OSError, PeerError, ValueError) as e:
                        log.warning("the memory of node %d (%s:%d) cannot be read (%s): its "
                                    "chunks come from the store", node.rank, node.host,
                                    node.port, e)
                self._where = where
            return self._where

    def _client(self, node: Node) -> PeerClient:
        clients: dict[int, PeerClient] = self._local.__dict__.setdefault("clients", {})
        client = clients.get(node.rank)
        if client is None:
            client = clients[node.rank] = PeerClient(node, self._token)
            self._clients.append(client)
        return client

    def holds(self, d: str) -> bool:
        return d in self._index()

    def read(self, d: str, dest: memoryview) -> bool:
        """Chunk ``d`` into ``dest`` from the node that holds it; False where none could
        give it (the caller reads the store). The caller checks the bytes."""
        node = self._index().get(d)
        if node is None:
            return False
        try:
            return self._client(node).get(d, dest)
        except (OSError, PeerError, ValueError) as e:
            log.warning("reading a chunk from node %d (%s) failed (%s): from the store",
                        node.rank, node.host, e)
            clients: dict[int, PeerClient] = self._local.__dict__.get("clients", {})
            broken = clients.pop(node.rank, None)
            if broken is not None:
                broken.close()
            return False

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()


def push(node: Node, token: str, src: int, sid: str,
         chunks: Iterator[tuple[str, int, int, int]] | list[tuple[str, int, int, int]],
         still: Callable[[], bool]) -> tuple[int, int]:
    """Send node ``node`` a replica of this node's chunks (digest, bytes, fd, offset), as
    snapshot ``sid`` of source ``src``; ``still()`` False abandons it (the chunks are
    changing). Returns (chunks sent, bytes sent)."""
    entries = list(chunks)
    by_digest = {d: (n, fd, off) for d, n, fd, off in entries}
    client = PeerClient(node, token)
    sent = nbytes = 0
    try:
        missing = client.call({"op": "put_begin", "src": src, "sid": sid,
                               "entries": [[d, n] for d, (n, _, _) in by_digest.items()]}
                              )["missing"]
        for d, n in missing:
            if not still():
                raise PeerError("the chunks changed while they were sent")
            _, fd, off = by_digest[str(d)]
            client.send_fd({"op": "put", "d": d}, fd, off, int(n))
            reply = recv_frame(client._sock)
            if not reply.get("ok"):  # a chunk staged anew while it was sent arrives torn
                raise PeerError("the chunks changed while they were sent" if not still()
                                else f"node {node.rank}: {reply.get('why')}")
            sent, nbytes = sent + 1, nbytes + int(n)
        if not still():
            raise PeerError("the chunks changed while they were sent")
        client.call({"op": "put_end"})
    finally:
        client.close()
    return sent, nbytes
