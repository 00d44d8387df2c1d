"""The peer service against clients and servers that do not follow the protocol
(``ciuic.supervisor.peers``, ``wire``, ``peer_messages``): real supervisors' holders and their
chunk services on this machine's loopback, real sockets. A connection before login costs the
node almost nothing and not for long; both ends prove the job's token; a frame altered, replayed
or malformed is refused; a replica is bound to its sender and to the memory budget while it
travels; a reader leaves out a node that fails."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import ciuic.supervisor.peers as peers
from ciuic.format.digest import digest
from ciuic.supervisor.channel import Link
from ciuic.supervisor.holder import Holder
from ciuic.supervisor.peers import Node, PeerClient, PeerError, PeerReader
from tests.test_peers import TOKEN, _join, _publish, _wait
from tests.test_peers import two_holders as two_holders  # (the fixture two)


@contextlib.contextmanager
def _server(**limits: float) -> Iterator[tuple[Holder, Node]]:
    """A node's holder and a chunk service of it on 127.0.0.1 with ``limits``."""
    holder = Holder(budget=64 << 20)
    server = peers.PeerServer(holder, lambda: TOKEN, "127.0.0.1", **limits)  # type: ignore[arg-type]
    try:
        yield holder, Node(0, "127.0.0.1", server.port)
    finally:
        server.close()
        holder.close()


def _closed_by_peer(sock: socket.socket, timeout: float = 60.0) -> bool:
    """Whether the other end closes ``sock`` (reading and dropping what it sends first)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def _peak_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_a_frame_announced_before_login_is_refused_without_allocating_it() -> None:
    with _server() as (_, node):
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # the peak RSS starts again from now
        before = _peak_rss()
        conns = [socket.create_connection((node.host, node.port)) for _ in range(3)]
        for c in conns:  # a header of 256 MiB is announced, and nothing follows
            c.sendall(struct.pack("!IQ", 1 << 28, 0))
        assert all(_closed_by_peer(c) for c in conns)
        assert _peak_rss() - before < 32 << 20
        for c in conns:
            c.close()


def test_a_client_that_trickles_its_hello_is_dropped_at_the_handshake_deadline() -> None:
    with _server(handshake_s=1.0) as (_, node):
        sock = socket.create_connection((node.host, node.port))
        hello = json.dumps({"op": "hello", "nonce": "ab" * 16, "node": None,
                            "mac": "00" * 32}).encode()
        frame = struct.pack("!IQ", len(hello), 0) + hello
        sent = 0
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for i in range(len(frame)):  # a byte each 0.2 s: each read waits far less than
                sent = i  # its timeout, the whole far longer than the deadline
                sock.sendall(frame[i:i + 1])
                time.sleep(0.2)
        assert sent < len(frame) - 1  # the server closed it before the hello was whole
        sock.close()


def test_connections_past_the_handshake_limit_are_closed_at_once() -> None:
    with _server(max_handshakes=2) as (_, node):
        silent = [socket.create_connection((node.host, node.port)) for _ in range(2)]
        for s in silent:  # each holds a handshake open: it got the server's nonce
            s.settimeout(10)
            assert s.recv(4096)
        third = socket.create_connection((node.host, node.port))
        assert _closed_by_peer(third, timeout=10) and third.recv(1) == b""
        for s in silent:
            s.close()
        # the places free again: a client with the token logs in
        _wait(lambda: _pings(node))


def test_connections_past_the_connection_limit_are_closed_at_once() -> None:
    with _server(max_connections=2) as (_, node):
        clients = [PeerClient(node, TOKEN) for _ in range(2)]
        with pytest.raises(ConnectionError):
            PeerClient(node, TOKEN)
        clients.pop().close()
        _wait(lambda: _pings(node))  # a place is free again
        clients[0].close()


def test_a_logged_in_connection_that_asks_nothing_is_closed() -> None:
    with _server(idle_s=1.0) as (_, node):
        client = PeerClient(node, TOKEN)
        assert client.ping()["ok"]
        assert _closed_by_peer(client._sock, timeout=30)
        client.close()


def _pings(node: Node) -> bool:
    try:
        client = PeerClient(node, TOKEN)
    except (OSError, PeerError):
        return False
    try:
        return client.ping()["ok"] is True
    finally:
        client.close()


def test_the_default_limit_turns_away_connections_that_never_log_in() -> None:
    with _server() as (_, node):
        silent = [socket.create_connection((node.host, node.port))
                  for _ in range(peers.MAX_HANDSHAKES)]
        for s in silent:
            s.settimeout(10)
            assert s.recv(4096)
        extra = socket.create_connection((node.host, node.port))
        assert _closed_by_peer(extra, timeout=10)
        for s in [*silent, extra]:
            s.close()


def test_a_node_serves_only_on_the_address_it_told_the_others(two: list[Holder]) -> None:
    port = Link(two[0].name, 0, two[0].secret).request({"op": "listen"})[0]["port"]
    with pytest.raises(ConnectionRefusedError):  # before the job's nodes are known: nothing
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    nodes = _join(two)
    assert nodes[0].port == port and _pings(nodes[0])
    with pytest.raises(ConnectionRefusedError):  # another address of this machine
        socket.create_connection(("127.0.0.2", port), timeout=5).close()


class _Impostor:
    """A server on 127.0.0.1 that speaks the handshake without the token: it says yes to any
    hello."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.node = Node(0, "127.0.0.1", self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                with conn:
                    _send_plain(conn, {"v": 2, "nonce": "cd" * 16})
                    conn.recv(4096)
                    _send_plain(conn, {"ok": True, "mac": "00" * 32})
                    conn.recv(4096)


def _send_plain(sock: socket.socket, header: object) -> None:
    data = json.dumps(header).encode()
    sock.sendall(struct.pack("!IQ", len(data), 0) + data)


def test_a_server_that_does_not_hold_the_token_is_refused_by_the_client() -> None:
    impostor = _Impostor()
    with pytest.raises(PeerError, match="did not prove that it holds this job's token"):
        PeerClient(impostor.node, TOKEN)
    impostor.sock.close()


class _Relay:
    """A man in the middle on 127.0.0.1 that forwards one connection to ``to``, and flips a
    byte of what the server sends once :attr:`armed` (in the first read of 200 bytes or more,
    100 bytes before its end)."""

    def __init__(self, to: Node) -> None:
        self._to = to
        self.armed = False
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.node = Node(to.rank, "127.0.0.1", self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.sock.accept()
        server = socket.create_connection((self._to.host, self._to.port))
        threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
        self._pump(server, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, tamper: bool) -> None:
        with contextlib.suppress(OSError):
            while data := bytearray(src.recv(1 << 20)):
                if tamper and self.armed and len(data) >= 200:
                    data[-100] ^= 0x01
                    self.armed = False
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_RDWR)


def test_a_chunk_altered_on_the_way_after_login_is_refused(two: list[Holder]) -> None:
    nodes = _join(two)
    piece = os.urandom(10_000)
    (d,) = _publish(two[0], 0, "s1", [piece])
    relay = _Relay(nodes[0])
    client = PeerClient(relay.node, TOKEN)
    dest = bytearray(len(piece))
    assert client.get(d, memoryview(dest)) and bytes(dest) == piece  # the relay passes it
    relay.armed = True
    with pytest.raises(PeerError, match="altered"):
        client.get(d, memoryview(bytearray(len(piece))))
    client.close()
    relay.sock.close()


def test_a_frame_replayed_after_login_is_refused() -> None:
    from ciuic.supervisor.wire import Wire

    a, b = socket.socketpair()
    tap, sink = socket.socketpair()
    sender, receiver = Wire(a), Wire(sink)
    sender.login(b"k" * 32, b"r" * 32)
    receiver.login(b"r" * 32, b"k" * 32)
    sender.send({"op": "ping"})
    raw = b.recv(65536)  # one frame, as it crossed the network
    tap.sendall(raw + raw)  # ... and again
    assert receiver.recv().header == {"op": "ping"}
    with pytest.raises(PeerError, match="tag does not match"):
        receiver.recv()
    for s in (a, b, tap, sink):
        s.close()


@pytest.mark.parametrize("logged_in", [False, True])
def test_a_deeply_nested_header_is_a_protocol_error(logged_in: bool) -> None:
    from ciuic.supervisor.wire import Wire

    a, b = socket.socketpair()
    sender, receiver = Wire(a), Wire(b)
    nested = b"[" * 50_000
    if logged_in:
        sender.login(b"k" * 32, b"r" * 32)
        receiver.login(b"r" * 32, b"k" * 32)
        threading.Thread(target=sender.send, args=({"x": 0},), daemon=True).start()
        receiver.recv()  # (sequence numbers in step)
        from ciuic.supervisor.wire import _mac

        prefix = struct.pack("!IQ", len(nested), 0)
        tag = _mac(b"k" * 32, b"h", struct.pack("!Q", 1), prefix, nested)
        threading.Thread(target=a.sendall, args=(prefix + nested + tag,), daemon=True).start()
        with pytest.raises(PeerError, match="not JSON"):
            receiver.recv()
    else:
        threading.Thread(target=a.sendall, args=(struct.pack("!IQ", len(nested), 0)
                                                 + nested,), daemon=True).start()
        with pytest.raises(PeerError, match="before login"):
            receiver.recv()
    a.close()
    b.close()


# -- replicas: budget, source, malformed requests ------------------------------------------


def test_replicas_in_transit_side_by_side_count_against_the_budget() -> None:
    a, b = Holder(budget=64 << 20), Holder(budget=8 << 20)
    try:
        nodes = _join([a, b])
        clients = [PeerClient(nodes[1], TOKEN, me=0) for _ in range(3)]
        refused = []
        for i, client in enumerate(clients):  # three replicas of 6 MiB, none complete yet
            entry = [digest(bytes([i]) * 16), 6 << 20]
            try:
                client.call({"op": "put_begin", "src": 0, "sid": f"s{i}", "entries": [entry]})
            except PeerError as e:  # a refusal is a reply: the connection goes on
                refused.append(str(e))
                assert client.ping()["ok"]
        assert len(refused) == 2 and all("--host-memory" in r for r in refused)
        for client in clients:
            client.close()
    finally:
        a.close()
        b.close()


def test_a_replica_in_transit_gives_way_to_the_nodes_own_copy() -> None:
    a, b = Holder(budget=64 << 20), Holder(budget=8 << 20)
    try:
        nodes = _join([a, b])
        data = os.urandom(6 << 20)
        client = PeerClient(nodes[1], TOKEN, me=0)
        client.call({"op": "put_begin", "src": 0, "sid": "s",
                     "entries": [[digest(data), len(data)]]})
        _publish(b, 0, "own", [os.urandom(4 << 20)])  # a rank of node 1 stages 4 MiB
        assert b.released is None
        with pytest.raises(PeerError, match="dropped to keep this node's own copy"):
            client.call({"op": "put", "d": digest(data)}, data)
        client.close()
        assert b.replicas.by_src == {}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("me", "src", "why"), [
    (0, -1, "src is not a whole number"),
    (7, 7, "node 7 is not another node of this job"),
    (0, 1, "a replica of node 1 on a connection of node 0"),
    (1, 1, "node 1 is not another node of this job"),  # the receiver itself
    (None, 0, "a replica of node 0 on a connection of node None"),
])
def test_a_replica_from_a_forged_source_is_refused(two: list[Holder], me: int | None,
                                                   src: int, why: str) -> None:
    nodes = _join(two)
    good = os.urandom(1000)
    client = PeerClient(nodes[1], TOKEN, me=me)
    with pytest.raises(PeerError, match=why):
        client.call({"op": "put_begin", "src": src, "sid": "s",
                     "entries": [[digest(good), len(good)]]})
    assert client.ping()["ok"]  # the connection goes on
    client.close()
    assert two[1].replicas.by_src == {}
    index = Link(two[1].name, 0, two[1].secret).request({"op": "chunks"})[0]
    assert index["chunks"] == []


@pytest.mark.parametrize(("request_", "why"), [
    ({"op": "get", "d": 5, "n": 10}, "get's d is not a digest"),
    ({"op": "get", "d": "0" * 64}, "get's n is not a whole number"),
    ({"op": "get", "d": "0" * 64, "n": True}, "get's n is not a whole number"),
    ({"op": "put_begin", "src": 0, "sid": "s", "entries": [[1]]}, "not \\[digest, bytes\\]"),
    ({"op": "put_begin", "src": 0, "sid": "s", "entries": None}, "entries is not a list"),
    ({"op": "put_begin", "src": 0, "entries": []}, "sid is not a name"),
    ({"op": "put", "d": "0" * 64}, "put before put_begin"),
    ({"op": "put_end"}, "put_end before put_begin"),
    ({"op": "nope"}, "unknown request 'nope'"),
    ({}, "unknown request 'None'"),
])
def test_a_malformed_request_is_answered_and_the_connection_goes_on(
        request_: dict[str, object], why: str) -> None:
    with _server() as (_, node):
        client = PeerClient(node, TOKEN)
        with pytest.raises(PeerError, match=why):
            client.call(request_)
        assert client.ping()["ok"]
        client.close()


def test_a_reader_leaves_out_a_node_that_fails(two: list[Holder]) -> None:
    nodes = _join(two)
    ds = _publish(two[0], 0, "s1", [os.urandom(5000), os.urandom(5000)])
    reader = PeerReader([nodes[0]], me=1, token=TOKEN)
    assert reader.holds(ds[0]) and reader.holds(ds[1])
    two[0].close()  # the node is gone; in its place, a port that takes connections and
    # closes them (a node that restarts, or a firewall)
    gone = socket.create_server((nodes[0].host, nodes[0].port))
    accepted = []

    def close_each() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = gone.accept()
                accepted.append(conn)
                conn.close()

    threading.Thread(target=close_each, daemon=True).start()
    assert not reader.read(ds[0], memoryview(bytearray(5000)))
    tried = len(accepted)
    assert not reader.read(ds[1], memoryview(bytearray(5000)))
    assert not reader.holds(ds[1])
    assert len(accepted) == tried  # the node was not tried again
    reader.close()
    gone.close()


# -- fuzz --------------------------------------------------------------------------------


_json = st.recursive(st.none() | st.booleans() | st.integers()
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_ops = st.sampled_from(["ping", "index", "get", "put_begin", "put", "put_end", "x"])
_headers = st.dictionaries(st.sampled_from(["op", "d", "n", "src", "sid", "entries"]),
                           _json, max_size=5) | st.builds(
    lambda op, rest: {**rest, "op": op}, _ops,
    st.dictionaries(st.sampled_from(["d", "n", "src", "sid", "entries"]), _json, max_size=4))


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Node]:
    with _server() as (_, node):
        yield node


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2048))
@example(data=struct.pack("!IQ", 50_000, 0) + b"[" * 50_000)
@example(data=struct.pack("!IQ", 1 << 28, 0))
@example(data=struct.pack("!IQ", 4, 5) + b"{}{}")
def test_fuzz_bytes_before_login_are_refused_and_the_server_goes_on(fuzzed: Node,
                                                                   data: bytes) -> None:
    sock = socket.create_connection((fuzzed.host, fuzzed.port))
    with contextlib.suppress(OSError):
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    assert _closed_by_peer(sock, timeout=30)
    sock.close()
    assert _pings(fuzzed)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture])
@given(headers=st.lists(_headers, min_size=1, max_size=4),
       payload=st.binary(max_size=64))
def test_fuzz_requests_after_login_are_answered_and_the_connection_goes_on(
        fuzzed: Node, headers: list[dict[str, object]], payload: bytes) -> None:
    client = PeerClient(fuzzed, TOKEN, me=1)
    try:
        for header in headers:
            with contextlib.suppress(PeerError):
                client.call(header, payload if header.get("op") == "put" else b"")
        assert client.ping()["ok"]
    finally:
        client.close()
