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

Only the workers of this ``ciuic run`` may connect (docs/architecture.md, "The channel"): a
process of another user is refused, every connection must say this start's :attr:`Holder.secret`
first and acts for the rank it said then, a buffer is kept only once sealed against resizing
and only when its descriptor holds what its ``put`` says, and another rank's buffers (and the
replicas) are lent read-only.

A training process that dies leaves its buffers here, for the next start. When the supervisor
exits, or is killed, the kernel closes its descriptors, and the memory is freed once no process
maps it any more: nothing can leak. The holder keeps at most ``budget`` bytes; a buffer that
would exceed it releases every host copy (a partial copy would serve no restore), and training
goes on with ordinary memory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import logging
import mmap
import os
import secrets
import socket
import stat
import struct
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ciuic.format.chunks import HEADER_BYTES as SKEW
from ciuic.supervisor import beat
from ciuic.supervisor import messages as msg
from ciuic.supervisor.channel import ENV, FDS_PER_MESSAGE, KEY_ENV, receive, send
from ciuic.supervisor.messages import ProtocolError
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
        #: what every connection must say first; a new one each start (:meth:`new_start`)
        self.secret = secrets.token_hex(16)
        self._conns: dict[socket.socket, str] = {}  # each open connection -> its secret
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

    def environment(self) -> dict[str, str]:
        """What the workers find the channel by: its name and this start's secret."""
        return {ENV: self.name, KEY_ENV: self.secret}

    def new_start(self) -> dict[str, str]:
        """A new secret for a new start (:meth:`environment`): connections of the starts
        before, whose workers are gone, are closed, and their secret opens no new one."""
        with self._lock:
            self.secret = secrets.token_hex(16)
            for conn, said in self._conns.items():
                if said != self.secret:
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)
        return self.environment()

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
            rank = self._hello(conn)
            if rank is None:
                return
            try:
                while self._answer(conn, rank):
                    pass
            finally:
                with self._lock:
                    self._conns.pop(conn, None)

    def _hello(self, conn: socket.socket) -> int | None:
        """The rank a new connection acts for; None where it is refused (told why)."""
        try:
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            if uid != os.geteuid():
                return self._refuse(conn, pid, f"a process of uid {uid} may not use the "
                                    f"channel of a ciuic run of uid {os.geteuid()} (run the "
                                    "job as the user that runs ciuic run)")
            message, fds = receive(conn)
            _close(fds)
            if message is None:
                return None
            said = msg.parse(message)
        except ProtocolError as e:
            return self._refuse(conn, pid, f"protocol error: {e}")
        except OSError:
            return None
        with self._lock:
            known = isinstance(said, msg.Hello) and hmac.compare_digest(
                said.secret.encode("utf-8", "surrogatepass"), self.secret.encode())
            if known:
                self._conns[conn] = self.secret
        if not isinstance(said, msg.Hello) or not known:
            return self._refuse(conn, pid, "a connection must first say hello with the secret "
                                f"of this start ({KEY_ENV}, which ciuic run gives its workers)")
        try:
            send(conn, {"ok": True})
        except OSError:
            return None
        return said.rank

    @staticmethod
    def _refuse(conn: socket.socket, pid: int, why: str) -> None:
        """Log and say why, and drop what the peer sends for a second more (a socket closed
        with messages unread resets the peer's, and it would not read why)."""
        log.warning("ciuic run: refused a connection of pid %d to its channel: %s", pid, why)
        with contextlib.suppress(OSError):
            send(conn, {"ok": False, "why": why})
            conn.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + 1.0
            while (left := deadline - time.monotonic()) > 0:
                conn.settimeout(left)
                data, fds, _, _ = socket.recv_fds(conn, 1, FDS_PER_MESSAGE)
                _close(fds)
                if not data:
                    return

    def _answer(self, conn: socket.socket, rank: int) -> bool:
        """Answer the next request of ``rank``'s connection; False once it is gone."""
        out: list[int] = []
        lent: list[int] = []
        try:
            message, fds = receive(conn)
        except ProtocolError as e:  # its descriptors are closed
            reply = {"ok": False, "why": f"protocol error: {e}"}
        except OSError:
            return False
        else:
            if message is None:
                return False
            reply, out, lent = self._request(rank, message, fds)
        try:
            send(conn, reply, out)
        except OSError:
            return False
        finally:
            _close(lent)
        return True

    def _request(self, rank: int, message: dict[str, Any], fds: list[int]
                 ) -> tuple[dict[str, Any], list[int], list[int]]:
        """The reply to one request, the descriptors to send with it, and those of them to
        close once sent. Takes ``fds``: each is kept (a put's buffer) or closed."""
        try:
            m = msg.parse(message)
            if not isinstance(m, msg.Put):
                _close(fds)
                fds = []
            elif len(fds) != 1:
                raise ProtocolError(f"put takes one descriptor, not {len(fds)}")
            if isinstance(m, msg.Fetch):  # its descriptor is closed once sent
                reply, out = self._fetch(asdict(m))
                return reply, out, out
            if isinstance(m, msg.Fds):
                return self._fds(rank, m)
            return (*self._handle(rank, m, fds), [])
        except ProtocolError as e:
            _close(fds)
            return {"ok": False, "why": f"protocol error: {e}"}, [], []
        except Exception as e:  # a request that cannot be met: answered, never fatal here
            _close(fds)
            return {"ok": False, "why": f"{type(e).__name__}: {e}"}, [], []

    def _handle(self, rank: int, m: msg.Request, fds: list[int]
                ) -> tuple[dict[str, Any], list[int]]:
        """``fds`` (a put's one descriptor) is kept or closed here, unless this raises."""
        with self._lock:
            r = self._ranks.setdefault(rank, _Rank())
            if isinstance(m, msg.Attach):
                return self._attach(r), [self._fd]
            if isinstance(m, msg.Put):
                return self._put(r, m, fds[0]), []
            if isinstance(m, msg.Free):
                for i in m.ids:
                    b = r.buffers.pop(i, None)
                    if b is not None:
                        os.close(b.fd)
                    if i in r.ids:  # a published buffer is gone: no host copy
                        r.unpublish()
                        self._generation += 1
                return {"ok": True}, []
            if isinstance(m, msg.Invalidate):
                r.unpublish()
                self._generation += 1
                return {"ok": True}, []
            if isinstance(m, msg.Publish):
                return self._publish(r, m), []
            if isinstance(m, msg.Chunks):
                return self._index(), []
            if isinstance(m, msg.Listen):
                return self._listen(), []
            if isinstance(m, msg.Said):
                return {"ok": True, "restart": self.restart}, []
            if isinstance(m, msg.Peers):
                return self._join(asdict(m)), []
        raise ProtocolError(f"rank {rank} already said hello on this connection")

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

    def _fds(self, rank: int, m: msg.Fds) -> tuple[dict[str, Any], list[int], list[int]]:
        """Descriptors of this rank's buffers, or lent read-only: another rank's published
        ones, a replica's (the third list: the read-only ones, closed once sent)."""
        ids = list(m.ids[:FDS_PER_MESSAGE])
        with self._lock:
            if m.owner is not None and m.owner < 0:  # a replica of node -1 - owner
                reply, fds = self._replica_fds(m.owner, ids)
            elif m.owner is not None and m.owner != rank:
                other = self._ranks.get(m.owner)  # another rank's: only what it published
                if other is None or not other.published() or not set(ids) <= set(other.ids):
                    return ({"ok": False, "why": f"rank {m.owner} no longer publishes these "
                             "buffers"}, [], [])
                reply, fds = {"ok": True, "ids": ids}, [other.buffers[i].fd for i in ids]
            else:
                r = self._ranks.setdefault(rank, _Rank())
                if not all(i in r.buffers for i in ids):
                    return {"ok": False, "why": "unknown buffers"}, [], []
                return {"ok": True, "ids": ids}, [r.buffers[i].fd for i in ids], []
            lent = []
            try:
                for fd in fds:
                    lent.append(_read_only(fd))
            except BaseException:
                _close(lent)
                raise
        return reply, lent, lent

    def _put(self, r: _Rank, m: msg.Put, fd: int) -> dict[str, Any]:
        """Keep (or close) ``fd``, buffer ``m.id`` of ``m.nbytes``, once it is sealed against
        resizing and holds that many: a put that says more than its descriptor holds is
        refused before it counts against the budget (raising, the caller closes ``fd``)."""
        _sealed(fd, SKEW + m.nbytes)
        if self.budget is None or self.released is not None:
            os.close(fd)
            return {"ok": False, "why": self.released or "no host-memory tier"}
        self._make_room(m.nbytes)
        held = self._ranks_held()
        if held + m.nbytes > self.budget:
            os.close(fd)
            why = (f"the host copy would hold {_gib(held + m.nbytes)}, over its budget of "
                   f"{_gib(self.budget)} (ciuic run --host-memory)")
            self._release(why)
            log.warning("ciuic run: host-memory copy released: %s; restarts restore "
                        "from the store", why)
            return {"ok": False, "why": why}
        old = r.buffers.pop(m.id, None)
        if old is not None:
            os.close(old.fd)
        r.buffers[m.id] = _Buffer(fd, m.nbytes)
        return {"ok": True}

    def _publish(self, r: _Rank, m: msg.Publish) -> dict[str, Any]:
        ids = list(m.ids)
        if self.released is not None or not all(i in r.buffers for i in ids):
            return {"ok": False, "why": self.released or "unknown buffers"}
        known = set(ids)
        spans = ([(x.buffer, x.offset, x.nbytes) for x in m.leaves]
                 + [(c.buffer, c.offset, c.nbytes) for c in m.chunks])
        for i, off, n in spans:
            if i not in known or off + n > r.buffers[i].nbytes:
                raise ValueError(f"bytes {off}..{off + n} of buffer {i} are not published")
        r.snapshot, r.step, r.ids = m.snapshot, m.step, ids
        r.leaves = [[x.path, x.buffer, x.offset, x.nbytes] for x in m.leaves]
        r.chunks = [[c.digest, c.nbytes, c.buffer, c.offset] for c in m.chunks]
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


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


_RESIZE = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def _sealed(fd: int, nbytes: int) -> None:
    """Check that ``fd`` is a memfd of at least ``nbytes``, and seal it against resizing (so
    that no mapping of it faults), and its mode read-only for its owner (so that a descriptor
    lent read-only is not opened again for writing through /proc); :class:`ProtocolError`
    otherwise."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError("put takes a memfd")
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _RESIZE)
    except OSError as e:
        raise ProtocolError(f"put takes a memfd made with MFD_ALLOW_SEALING ({e})") from None
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise ProtocolError(f"put says {nbytes - SKEW} bytes, and its memfd holds "
                            f"{max(0, size - SKEW)}")
    os.fchmod(fd, 0o400)


def _read_only(fd: int) -> int:
    """A read-only descriptor of what ``fd`` opens (the caller closes it)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
