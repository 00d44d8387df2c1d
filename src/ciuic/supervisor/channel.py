"""The local channel between ``ciuic run`` and the training processes it supervises.

An abstract Unix socket (``SOCK_SEQPACKET``: one message per request, file descriptors passed
with ``SCM_RIGHTS``), named in ``CIUIC_SUPERVISOR``. Abstract names live in no file system, so a
supervisor that is killed leaves nothing behind.

Through it a rank *attaches* (it receives the heartbeat region and, after a restart, the host
copy of its rank's latest snapshot) and hands the supervisor its staging buffers: each is a
``memfd`` (anonymous shared memory) that the rank maps and the supervisor keeps open. A training
process that dies leaves its buffers with the supervisor, which gives them to the next start.
When the supervisor exits, or is killed, the kernel closes its descriptors, and the memory is
freed once no process maps it any more: nothing can leak.

The supervisor holds at most ``budget`` bytes; a buffer that would exceed it releases the whole
host copy (a partial copy would serve no restore), and the training goes on with ordinary
memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import secrets
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from ciuic.supervisor import beat

log = logging.getLogger("ciuic")
ENV = "CIUIC_SUPERVISOR"
#: what ``ciuic run`` tells each restarted job of the start before it, through the job's
#: environment (set by the agent, read by ``manager/supervised.Restart``): the restart's
#: number, the cause's line, the last step() seen, the processes that stopped
RESTART_ENV = "CIUIC_RUN_RESTART"
CAUSE_ENV = "CIUIC_RUN_CAUSE"
STOPPED_AT_ENV = "CIUIC_RUN_STOPPED_AT"
PIDS_ENV = "CIUIC_RUN_PIDS"
_MAX_MESSAGE = 1 << 16
FDS_PER_MESSAGE = 200  # SCM_RIGHTS takes at most 253


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:  # type: ignore[assignment]
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > _MAX_MESSAGE:
        raise ValueError(f"supervisor message of {len(data)} bytes, over {_MAX_MESSAGE}")
    socket.send_fds(sock, [data], list(fds)) if fds else sock.sendall(data)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and its descriptors; (None, []) when the peer is gone."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, FDS_PER_MESSAGE)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), list(fds)


# -- the supervisor's side ----------------------------------------------------------------------


@dataclass
class _Buffer:
    fd: int
    path: str
    nbytes: int


@dataclass
class _Rank:
    buffers: dict[int, _Buffer] = field(default_factory=dict)
    #: the snapshot every buffer of ``ids`` holds, as the rank published it at its commit
    snapshot: str | None = None
    step: int | None = None
    ids: list[int] = field(default_factory=list)


class Holder:
    """The supervisor's end: serves attaches, keeps the buffers, and the heartbeat region."""

    def __init__(self, budget: int | None) -> None:
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
                    for fd in fds:
                        os.close(fd)
                    reply, out = {"ok": False, "why": f"{type(e).__name__}: {e}"}, []
                try:
                    send(conn, reply, out)
                except OSError:
                    return

    def _handle(self, m: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        op = m["op"]
        rank = int(m.get("rank", 0))
        with self._lock:
            r = self._ranks.setdefault(rank, _Rank())
            if op == "attach":
                # buffers the last process registered but did not publish are garbage now
                keep = set(r.ids) if r.snapshot is not None else set()
                for i in [i for i in r.buffers if i not in keep]:
                    os.close(r.buffers.pop(i).fd)
                copy = None
                if r.snapshot is not None and all(i in r.buffers for i in r.ids):
                    copy = {"snapshot": r.snapshot, "step": r.step,
                            "entries": [[r.buffers[i].path, i, r.buffers[i].nbytes]
                                        for i in r.ids]}
                return {"ok": True, "tier": self.budget is not None and self.released is None,
                        "copy": copy, "why": self.released}, [self._fd]
            if op == "fds":
                ids = [int(i) for i in m["ids"]][:FDS_PER_MESSAGE]
                return {"ok": True, "ids": ids}, [r.buffers[i].fd for i in ids]
            if op == "put":
                if len(fds) != 1:
                    raise ValueError("put takes one descriptor")
                nbytes = int(m["nbytes"])
                if self.budget is None or self.released is not None:
                    os.close(fds[0])
                    return {"ok": False, "why": self.released or "no host-memory tier"}, []
                held = sum(b.nbytes for x in self._ranks.values() for b in x.buffers.values())
                if held + nbytes > self.budget:
                    os.close(fds[0])
                    why = (f"the host copy would hold {_gib(held + nbytes)}, over its budget of "
                           f"{_gib(self.budget)} (ciuic run --host-memory)")
                    self._release(why)
                    log.warning("ciuic run: host-memory copy released: %s; restarts restore "
                                "from the store", why)
                    return {"ok": False, "why": why}, []
                old = r.buffers.pop(int(m["id"]), None)
                if old is not None:
                    os.close(old.fd)
                r.buffers[int(m["id"])] = _Buffer(fds[0], str(m["path"]), nbytes)
                return {"ok": True}, []
            if op == "free":
                for i in m["ids"]:
                    b = r.buffers.pop(int(i), None)
                    if b is not None:
                        os.close(b.fd)
                    if int(i) in r.ids:  # a published buffer is gone: no host copy
                        r.snapshot, r.step, r.ids = None, None, []
                return {"ok": True}, []
            if op == "invalidate":
                r.snapshot, r.step, r.ids = None, None, []
                return {"ok": True}, []
            if op == "publish":
                ids = [int(i) for i in m["ids"]]
                if self.released is None and all(i in r.buffers for i in ids):
                    r.snapshot, r.step, r.ids = str(m["snapshot"]), int(m["step"]), ids
                    return {"ok": True}, []
                return {"ok": False, "why": self.released or "unknown buffers"}, []
        for fd in fds:
            os.close(fd)
        raise ValueError(f"unknown request {op!r}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


# -- the training process's side ----------------------------------------------------------------


class Link:
    """A training process's connection to its supervisor (every call is thread-safe)."""

    def __init__(self, name: str, rank: int) -> None:
        self.rank = rank
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(30.0)
        self._sock.connect("\0" + name)
        self._lock = threading.Lock()

    @staticmethod
    def from_env() -> Link | None:
        """The link to the supervisor named in ``CIUIC_SUPERVISOR``; None when not under
        ``ciuic run`` (or when it cannot be reached: logged, training goes on)."""
        name = os.environ.get(ENV)
        if not name:
            return None
        rank = int(os.environ.get("RANK", "0") or 0)
        try:
            return Link(name, rank)
        except OSError as e:
            log.warning("%s=%s is set but the supervisor cannot be reached (%s): no heartbeats "
                        "and no host-memory copy for this process", ENV, name, e)
            return None

    def request(self, message: dict[str, Any], fds: list[int] = ()  # type: ignore[assignment]
                ) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            send(self._sock, {**message, "rank": self.rank}, fds)
            reply, got = receive(self._sock)
        if reply is None:
            raise ConnectionError("the supervisor closed the channel")
        return reply, got

    def attach(self) -> tuple[mmap.mmap, dict[str, Any]]:
        """The heartbeat region, and the attach reply (``tier``, ``copy``)."""
        reply, fds = self.request({"op": "attach", "pid": os.getpid()})
        try:
            region = mmap.mmap(fds[0], beat.REGION_BYTES)
        finally:
            for fd in fds:
                os.close(fd)
        return region, reply

    def descriptors(self, ids: list[int]) -> list[int]:
        """Descriptors of the held buffers ``ids`` (the caller closes them)."""
        out: list[int] = []
        for i in range(0, len(ids), FDS_PER_MESSAGE):
            _, fds = self.request({"op": "fds", "ids": ids[i:i + FDS_PER_MESSAGE]})
            out.extend(fds)
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
