"""The frames between nodes' chunk services (:mod:`ciuic.supervisor.peers`), and the handshake
that proves both ends hold the job's token.

A frame is ``u32 header bytes | u64 payload bytes | header`` (a JSON object), then the payload.
Before login a frame's header is at most :data:`LOGIN_HEADER_BYTES` and it has no payload.

The handshake (the server speaks first; the whole of it within ``handshake_s``):

1. server: ``{"v": 2, "nonce": Ns}``;
2. client: ``{"op": "hello", "nonce": Nc, "node": its node rank or null,
   "mac": HMAC(token, "client" | Ns | Nc | node)}``;
3. server: ``{"ok": true, "mac": HMAC(token, "server" | Ns | Nc)}``, or ``{"ok": false,
   "why": ...}`` and it closes; the client checks the server's MAC.

Both ends then derive a key per direction, ``HMAC(token, "c2s" | Ns | Nc)`` and ``"s2c"``, and
every later frame carries tags under its direction's key: ``tag(header)``, HMAC-SHA256 over
``"h" | sequence number | the two lengths | header``, after the header, and ``tag(payload)``,
keyed BLAKE3 over ``"p" | sequence number | payload``, after a payload (hashed piece by piece
as it is sent and received). The sequence number counts the frames of a direction from 0 and is
not sent: a frame altered, replayed, reordered or dropped fails the next check, and the
connection ends (:class:`~ciuic.errors.PeerError`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import mmap
import os
import secrets
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import blake3

from ciuic.errors import PeerError

VERSION = 2
_PREFIX = struct.Struct("!IQ")
_SEQ = struct.Struct("!Q")
TAG_BYTES = 32
#: a header before login (the handshake's frames are a few hundred bytes)
LOGIN_HEADER_BYTES = 1024
#: a header after login (an index of a few million chunks)
MAX_HEADER_BYTES = 1 << 28
#: a payload (one chunk)
MAX_PAYLOAD_BYTES = 1 << 34
#: seconds a reply or the next byte of a frame is waited for
TIMEOUT_S = 30.0
#: a frame's payload may take TIMEOUT_S plus its bytes at this rate (a peer that trickles
#: bytes is dropped as one that sends none)
MIN_BYTES_PER_S = 1 << 20
_PIECE = 1 << 20  # a header grows by at most this much per read: memory follows the bytes sent


def payload_s(n: int) -> float:
    """The seconds a frame of ``n`` payload bytes may take."""
    return TIMEOUT_S + n / MIN_BYTES_PER_S


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float,
                step_s: float = TIMEOUT_S) -> None:
    """``view`` filled by ``deadline`` (monotonic), each read within ``step_s``."""
    while view:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the peer sent too slowly")
        sock.settimeout(min(left, step_s))
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        view = view[n:]


def _recv_grown(sock: socket.socket, n: int, deadline: float) -> bytearray:
    """``n`` bytes, in a buffer that grows as they arrive (a length alone allocates nothing)."""
    data = bytearray()
    while len(data) < n:
        piece = bytearray(min(n - len(data), _PIECE))
        _recv_exact(sock, memoryview(piece), deadline)
        data += piece
    return data


def _parse(data: bytes | bytearray) -> dict[str, Any]:
    try:
        header = json.loads(data)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise PeerError(f"a frame header that is not JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise PeerError("a frame header that is not a JSON object")
    return header


def _dump(header: dict[str, Any]) -> bytes:
    return json.dumps(header, separators=(",", ":"), allow_nan=False).encode()


def _mac(key: bytes, *parts: bytes | bytearray | memoryview) -> bytes:
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def _payload_mac(key: bytes, seq: bytes) -> blake3.blake3:
    """A payload's tag, keyed BLAKE3 (a MAC; twice as fast as HMAC-SHA256 here, and it hashes
    without the GIL, like ``hmac``)."""
    h = blake3.blake3(key=key)
    h.update(b"p" + seq)
    return h


@dataclass(frozen=True)
class Frame:
    header: dict[str, Any]
    #: payload bytes that follow (read them with :meth:`Wire.recv_payload`)
    n: int


class Wire:
    """One connection's frames: plain until :meth:`login`, tagged after it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._tx: bytes | None = None
        self._rx: bytes | None = None
        self._tx_seq = 0
        self._rx_seq = 0
        self._pending = 0  # payload bytes of the last frame, not read yet

    def login(self, tx: bytes, rx: bytes) -> None:
        self._tx, self._rx = tx, rx

    def send(self, header: dict[str, Any], payload: bytes | memoryview = b"",
             timeout: float = TIMEOUT_S) -> None:
        data = _dump(header)
        if self._tx is None and (payload or len(data) > LOGIN_HEADER_BYTES):
            raise ValueError("a frame before login is small and has no payload")
        prefix = _PREFIX.pack(len(data), len(payload))
        self.sock.settimeout(timeout)
        if self._tx is None:
            self.sock.sendall(prefix + data)
            return
        seq = _SEQ.pack(self._tx_seq)
        self._tx_seq += 1
        self.sock.sendall(prefix + data + _mac(self._tx, b"h", seq, prefix, data))
        if payload:
            # piece by piece: the hashing (without the GIL) overlaps the receiver's
            self.sock.settimeout(timeout + _PIECE / MIN_BYTES_PER_S)
            h = _payload_mac(self._tx, seq)
            view = memoryview(payload)
            for at in range(0, len(view), _PIECE):
                piece = view[at:at + _PIECE]
                h.update(piece)
                self.sock.sendall(piece)
            self.sock.sendall(h.digest())

    def recv(self, wait_s: float = TIMEOUT_S, within_s: float | None = None) -> Frame:
        """The next frame's header: its first byte within ``wait_s``, the whole header within
        ``within_s`` from now (default: :data:`TIMEOUT_S` from its first byte). A frame with a
        payload must have it read next (:meth:`recv_payload`)."""
        if self._pending:
            raise RuntimeError("the last frame's payload was not read")
        prefix = bytearray(_PREFIX.size)
        view = memoryview(prefix)
        end = None if within_s is None else time.monotonic() + within_s
        first = time.monotonic() + wait_s if end is None else end
        _recv_exact(self.sock, view[:1], first, step_s=wait_s)
        deadline = time.monotonic() + TIMEOUT_S if end is None else end
        _recv_exact(self.sock, view[1:], deadline)
        hn, pn = _PREFIX.unpack(prefix)
        if self._rx is None:
            if hn > LOGIN_HEADER_BYTES or pn:
                raise PeerError(f"a frame of {hn} + {pn} bytes before login (at most "
                                f"{LOGIN_HEADER_BYTES} + 0)")
            return Frame(_parse(_recv_grown(self.sock, hn, deadline)), 0)
        if hn > MAX_HEADER_BYTES or pn > MAX_PAYLOAD_BYTES:
            raise PeerError(f"a frame of {hn} + {pn} bytes")
        data = _recv_grown(self.sock, hn + TAG_BYTES, deadline)
        seq = _SEQ.pack(self._rx_seq)
        if not hmac.compare_digest(bytes(data[hn:]), _mac(self._rx, b"h", seq, prefix,
                                                          memoryview(data)[:hn])):
            raise PeerError("a frame whose tag does not match (altered, replayed or out of "
                            "order)")
        del data[hn:]
        header = _parse(data)
        self._pending = pn
        if not pn:
            self._rx_seq += 1
        return Frame(header, pn)

    def recv_payload(self, dest: memoryview | None) -> None:
        """The last frame's payload into ``dest`` (its length), or read and dropped (None);
        checked against its tag (raises :class:`PeerError` where it does not match: ``dest``
        then holds bytes that must not be used)."""
        n = self._pending
        if dest is not None and len(dest) != n:
            raise ValueError(f"a payload of {n} bytes into {len(dest)}")
        if not n:
            return
        assert self._rx is not None
        self._pending = 0
        seq = _SEQ.pack(self._rx_seq)
        self._rx_seq += 1
        deadline = time.monotonic() + payload_s(n)
        h = _payload_mac(self._rx, seq)
        into = dest if dest is not None else memoryview(bytearray(min(n, _PIECE)))
        for at in range(0, n, _PIECE):  # each piece hashed as it arrives
            size = min(n - at, _PIECE)
            part = into[at:at + size] if dest is not None else into[:size]
            _recv_exact(self.sock, part, deadline)
            h.update(part)
        tag = bytearray(TAG_BYTES)
        _recv_exact(self.sock, memoryview(tag), deadline)
        if not hmac.compare_digest(bytes(tag), h.digest()):
            raise PeerError("a payload whose tag does not match (altered in transit)")


# -- the handshake -------------------------------------------------------------------------


def _proof(token: str, what: str, *parts: object) -> bytes:
    """HMAC(token, what | part | ...): a handshake's proof, or a connection's key."""
    return _mac(token.encode(), "|".join([what, *map(str, parts)]).encode())


def _hello_mac(token: str, ns: str, nc: str, node: int | None) -> str:
    return _proof(token, "client", ns, nc, node).hex()


def _server_mac(token: str, ns: str, nc: str) -> str:
    return _proof(token, "server", ns, nc).hex()


def _keys(token: str, ns: str, nc: str) -> tuple[bytes, bytes]:
    """(client to server, server to client) keys of a connection."""
    return _proof(token, "c2s", ns, nc), _proof(token, "s2c", ns, nc)


def _nonce(header: dict[str, Any]) -> str:
    nonce = header.get("nonce")
    if not isinstance(nonce, str) or not 16 <= len(nonce) <= 128:
        raise PeerError("a handshake without a well-formed nonce")
    return nonce


def client_login(wire: Wire, token: str, node: int | None, handshake_s: float,
                 who: str) -> None:
    """The client's side of the handshake; raises :class:`PeerError` where the server refuses
    the token or does not prove it holds it too."""
    deadline = time.monotonic() + handshake_s

    def left() -> float:
        return max(0.001, deadline - time.monotonic())

    first = wire.recv(left(), left()).header
    if first.get("v") != VERSION:
        raise PeerError(f"{who} speaks another version of the protocol between nodes "
                        f"({first.get('v')!r}, not {VERSION}): run the same ciuic on every node")
    ns, nc = _nonce(first), secrets.token_hex(16)
    wire.send({"op": "hello", "nonce": nc, "node": node,
               "mac": _hello_mac(token, ns, nc, node)}, timeout=left())
    answer = wire.recv(left(), left()).header
    if answer.get("ok") is not True:
        raise PeerError(f"{who} refused this job's token")
    if not hmac.compare_digest(str(answer.get("mac")), _server_mac(token, ns, nc)):
        raise PeerError(f"{who} did not prove that it holds this job's token: it is not this "
                        "job's ciuic run")
    c2s, s2c = _keys(token, ns, nc)
    wire.login(c2s, s2c)


def server_login(wire: Wire, token: str | None, handshake_s: float) -> int | None:
    """The server's side of the handshake: the node rank the client said it is (None: a
    reader); raises :class:`PeerError` where it does not hold ``token``."""
    deadline = time.monotonic() + handshake_s

    def left() -> float:
        return max(0.001, deadline - time.monotonic())

    ns = secrets.token_hex(16)
    wire.send({"v": VERSION, "nonce": ns}, timeout=left())
    hello = wire.recv(left(), left()).header
    nc, node = _nonce(hello), hello.get("node")
    if node is not None and (type(node) is not int or node < 0):
        raise PeerError("a hello whose node is not a node rank")
    if token is None or not hmac.compare_digest(str(hello.get("mac")),
                                                _hello_mac(token, ns, nc, node)):
        wire.send({"ok": False, "why": "not this job's token"}, timeout=left())
        raise PeerError("a client without this job's token")
    wire.send({"ok": True, "mac": _server_mac(token, ns, nc)}, timeout=left())
    c2s, s2c = _keys(token, ns, nc)
    wire.login(s2c, c2s)
    return node


@contextlib.contextmanager
def mapped(fd: int, offset: int, n: int) -> Iterator[memoryview]:
    """Bytes ``offset`` to ``offset + n`` of the file ``fd``, mapped read-only."""
    if os.fstat(fd).st_size < offset + n:
        raise ValueError(f"{n} bytes at {offset} lie past the end of their buffer")
    if n == 0:
        yield memoryview(b"")
        return
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, offset + n - start, prot=mmap.PROT_READ, offset=start) as region:
        view = memoryview(region)[offset - start:]
        try:
            yield view
        finally:
            view.release()
