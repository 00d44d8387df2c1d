"""The nodes of a job that ``ciuic run --nproc-per-node N --nnodes M`` starts on several nodes
(docs/recovery.md, "Several nodes"): which node leads, and how each learns at once that
another is gone.

Every node runs one ``ciuic run``. Node 0 *leads*: it hosts the job's control store (at
``--master-addr:--master-port``) and each generation's rendezvous store, and decides when a
generation ends and who takes a lost node's place. Nodes ``1 .. M-1`` *follow*: they start
their own ranks and report their faults through the control store. A node started with a
node rank of ``M`` or more is a *spare node*: its warm spares wait until the leader gives it
a lost node's place.

Each follower keeps one TCP connection to the leader, the *node link*, on which both ends
send a byte every :data:`BEAT_S`. A node whose ``ciuic run`` is killed, or whose processes
all are (an OOM killer, a crash of the node's software), closes it: the other end reads the
end of the stream at once (the kernel's FIN or RST). A node that powers off, or is cut off
from the network (a cable pulled, a switch port down), falls silent: it is lost after
``timeout_s`` (``--peer-timeout``). A follower that loses the leader ends its ranks: the
control store is gone with it, and in-process recovery cannot go on (an outer restart, by
the scheduler, restores the job from its snapshots).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("ciuic.run")

#: seconds between two beats on a node link, each way
BEAT_S = 0.5
#: the longest hello a node sends (a JSON line)
HELLO_BYTES = 4096
#: the control store's key of the node link's port (set by the leader)
LINK = "nodes/link"
#: + a node rank: ``"SLOT GENERATION"``, the place a node takes from that generation on (the
#: leader sets it for a spare node, or a lost node started again, that takes a lost node's)
PLACE = "nodes/place/"


@dataclass(frozen=True)
class NodeSpec:
    """This node among the job's: ``nnodes`` nodes of ranks, this one's ``node_rank`` (from
    ``nnodes`` on: a spare node), the leader's address and control store port."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be 1 or more, not {self.nnodes}")
        if self.node_rank < 0:
            raise ValueError(f"--node-rank must be 0 or more, not {self.node_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be a TCP port (1-65535), not "
                             f"{self.master_port}")

    @property
    def leads(self) -> bool:
        return self.node_rank == 0

    @property
    def spare(self) -> bool:
        return self.node_rank >= self.nnodes


class Member:
    """A follower, as the leader sees it: its node rank, address, the slot it holds (None: a
    spare node not given one), when it last beat, and why it is lost (None: it is not)."""

    def __init__(self, node_rank: int, host: str, conn: socket.socket) -> None:
        self.node_rank, self.host, self.conn = node_rank, host, conn
        self.slot: int | None = None
        self.last = time.monotonic()
        self.lost: str | None = None
        self.said = False  # the loss was handed to the launcher

    def __repr__(self) -> str:
        return f"node {self.node_rank} ({self.host})"


def _send_beats(conn: socket.socket, closing: threading.Event) -> None:
    while not closing.wait(BEAT_S):
        try:
            conn.sendall(b".")
        except OSError:
            return


class LeaderLink:
    """The leader's end: accepts each follower's hello, hears their beats, and tells which
    are lost (:meth:`lost`)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._server = socket.create_server(("", 0), backlog=64)
        self.port = int(self._server.getsockname()[1])
        self.members: list[Member] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        threading.Thread(target=self._accept, name="ciuic-run-nodes", daemon=True).start()

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, (host, _) = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, str(host)),
                             name="ciuic-run-node", daemon=True).start()

    def _serve(self, conn: socket.socket, host: str) -> None:
        try:
            conn.settimeout(10.0)
            line = _read_line(conn)
            hello = json.loads(line)
            node_rank = hello.get("node_rank") if isinstance(hello, dict) else None
            if not isinstance(node_rank, int) or isinstance(node_rank, bool) or node_rank < 1:
                raise ValueError(f"not a follower's hello: {line[:80]!r}")
        except (OSError, ValueError) as e:
            log.warning("ciuic run: a connection from %s to the node link is not a node of "
                        "this job (%s): closed", host, e)
            with contextlib.suppress(OSError):
                conn.close()
            return
        m = Member(node_rank, host, conn)
        with self._lock:
            live = [x for x in self.members if x.node_rank == node_rank and x.lost is None]
            # its earlier starts in this job (a node's ciuic run started again): its names of
            # warm spares in the control store differ from theirs
            again = sum(1 for x in self.members if x.node_rank == node_rank)
            if not live:
                self.members.append(m)
        if live:
            log.error("ciuic run: %s says it is node %d, which %s already is: refused (two "
                      "nodes started with the same --node-rank?)", host, node_rank, live[0])
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": f"node {node_rank} is already in the job, "
                                         f"at {live[0].host}"}).encode() + b"\n")
                conn.close()
            return
        try:
            conn.settimeout(BEAT_S)
            conn.sendall(json.dumps({"ok": True, "again": again}).encode() + b"\n")
        except OSError as e:  # (gone at once, or the link closing)
            self._lose(m, f"its connection failed ({e})")
            return
        log.info("ciuic run: %s joined", m)
        threading.Thread(target=_send_beats, args=(conn, self._closing),
                         name="ciuic-run-beat", daemon=True).start()
        while not self._closing.is_set():
            try:
                got = conn.recv(64)
            except TimeoutError:
                continue
            except ConnectionResetError:
                got = b""  # (closed with a beat unread: a reset)
            except OSError as e:
                self._lose(m, f"its connection failed ({e})")
                return
            if not got:
                self._lose(m, "its ciuic run exited or the node went down (the node link "
                              "closed)")
                return
            m.last = time.monotonic()

    def _lose(self, m: Member, why: str) -> None:
        with self._lock:
            if m.lost is None:
                m.lost = why
        with contextlib.suppress(OSError):
            m.conn.close()

    def lost(self) -> list[Member]:
        """The members lost since the last call (closed, or silent past ``timeout_s``)."""
        now = time.monotonic()
        out = []
        with self._lock:
            for m in self.members:
                if m.lost is None and now - m.last > self.timeout_s:
                    m.lost = f"silent for {now - m.last:.1f} s (a network fault?)"
                    with contextlib.suppress(OSError):
                        m.conn.shutdown(socket.SHUT_RDWR)
                if m.lost is not None and not m.said:
                    m.said = True
                    out.append(m)
        return out

    def take(self, slot: int, exact: bool, spare_from: int) -> Member | None:
        """A live node without a slot, now holding ``slot``: the node of that rank (``exact``:
        only it, as at the job's start), else a spare node (node rank ``spare_from`` or more)
        or the lost node's ``ciuic run`` started again; never another node of ranks that
        waits for its own place. None where there is none."""
        with self._lock:
            free = [m for m in self.members if m.slot is None and m.lost is None
                    and (m.node_rank == slot or (not exact and m.node_rank >= spare_from))]
            free.sort(key=lambda m: (m.node_rank != slot, m.node_rank))
            if not free:
                return None
            free[0].slot = slot
            return free[0]

    def live(self) -> list[Member]:
        with self._lock:
            return [m for m in self.members if m.lost is None]

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            for m in self.members:
                with contextlib.suppress(OSError):
                    m.conn.close()


class FollowerLink:
    """A follower's end: its hello, its beats, and whether the leader is still there
    (:attr:`gone`: why not)."""

    def __init__(self, host: str, port: int, node_rank: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.conn = socket.create_connection((host, port), timeout=30.0)
        self.conn.sendall(json.dumps({"node_rank": node_rank}).encode() + b"\n")
        try:
            reply = json.loads(_read_line(self.conn))
        except (OSError, ValueError):
            self.conn.close()
            raise
        if not isinstance(reply, dict) or not reply.get("ok"):
            error = reply.get("error") if isinstance(reply, dict) else reply
            self.conn.close()
            raise ConnectionError(f"the job's leader refused this node: {error}")
        #: how many times a node of this rank joined the job before this one
        self.again = int(reply.get("again", 0))
        self.gone: str | None = None
        self._last = time.monotonic()
        self._closing = threading.Event()
        self.conn.settimeout(BEAT_S)
        threading.Thread(target=_send_beats, args=(self.conn, self._closing),
                         name="ciuic-run-beat", daemon=True).start()
        threading.Thread(target=self._hear, name="ciuic-run-leader", daemon=True).start()

    def _hear(self) -> None:
        while not self._closing.is_set():
            try:
                got = self.conn.recv(64)
            except TimeoutError:
                if time.monotonic() - self._last > self.timeout_s:
                    self.gone = (f"the leader (node 0) has been silent for "
                                 f"{time.monotonic() - self._last:.1f} s (a network fault?)")
                    return
                continue
            except ConnectionResetError:
                got = b""
            except OSError as e:
                self.gone = f"the connection to the leader (node 0) failed ({e})"
                return
            if not got:
                self.gone = ("the leader (node 0) closed the node link: its ciuic run exited "
                             "or its node went down")
                return
            self._last = time.monotonic()

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self.conn.close()


def _read_line(conn: socket.socket) -> str:
    """One line (without its newline) of at most :data:`HELLO_BYTES`."""
    buf = bytearray()
    while not buf.endswith(b"\n"):
        got = conn.recv(1)
        if not got:
            raise ConnectionError("the connection closed before its first line ended")
        buf += got
        if len(buf) > HELLO_BYTES:
            raise ValueError(f"a first line of more than {HELLO_BYTES} bytes")
    return buf[:-1].decode("utf-8", errors="replace")
