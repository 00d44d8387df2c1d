"""The local channel between ``ciuic run`` and the training processes it supervises.

An abstract Unix socket (``SOCK_SEQPACKET``: one message per request, file descriptors passed
with ``SCM_RIGHTS``), named in ``CIUIC_SUPERVISOR``. Abstract names live in no file system, so a
supervisor that is killed leaves nothing behind. Messages are JSON; one too large for a packet
travels in a sealed ``memfd`` passed with it (:func:`send`).

The supervisor's end is :class:`ciuic.supervisor.holder.Holder`; a training process's is
:class:`Link`, through which it attaches (the heartbeat region, the host copy its rank left),
hands over its staging buffers (each a ``memfd`` the supervisor keeps open), publishes what they
hold after a commit, and maps the buffers of the node's other ranks for a restore.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import socket
import threading
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
#: the key of a message whose JSON travels in the memfd passed last: its length in bytes
_PAYLOAD = "payload"


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:  # type: ignore[assignment]
    """Send ``message`` and ``fds``. JSON over a packet's size goes in a sealed memfd (the
    publish of a large state's chunk list, a node's index)."""
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) <= _MAX_MESSAGE:
        socket.send_fds(sock, [data], list(fds)) if fds else sock.sendall(data)
        return
    if len(fds) >= FDS_PER_MESSAGE:
        raise ValueError(f"a large supervisor message with {len(fds)} descriptors")
    fd = os.memfd_create("ciuic-message", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        _write_all(fd, data)
        seal(fd)
        socket.send_fds(sock, [json.dumps({_PAYLOAD: len(data)}).encode()], [*fds, fd])
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def seal(fd: int) -> None:
    """No more writes, growth or shrinking of memfd ``fd`` (created with
    ``MFD_ALLOW_SEALING``, and mapped writable nowhere any more)."""
    seals = getattr(os, "F_SEAL_WRITE", 8) | getattr(os, "F_SEAL_SHRINK", 2) | getattr(
        os, "F_SEAL_GROW", 4)
    with contextlib.suppress(OSError, AttributeError):  # a kernel without seals: a copy anyway
        import fcntl
        fcntl.fcntl(fd, getattr(fcntl, "F_ADD_SEALS", 1033), seals)


def receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next message and its descriptors; (None, []) when the peer is gone."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, FDS_PER_MESSAGE)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    message = json.loads(data)
    if isinstance(message, dict) and set(message) == {_PAYLOAD} and fds:
        fd, fds = fds[-1], fds[:-1]
        try:
            n = int(message[_PAYLOAD])
            with mmap.mmap(fd, n, prot=mmap.PROT_READ) as region:
                message = json.loads(region[:n])
        finally:
            os.close(fd)
    return message, list(fds)


# -- the training process's side ----------------------------------------------------------------


class Link:
    """A training process's connection to its supervisor (every call is thread-safe)."""

    def __init__(self, name: str, rank: int, timeout: float = 30.0) -> None:
        self.name = name
        self.rank = rank
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout)
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

    def descriptors(self, ids: list[int], owner: int | None = None) -> list[int]:
        """Descriptors of the held buffers ``ids`` of this rank, or of rank ``owner`` of this
        node (the caller closes them)."""
        out: list[int] = []
        try:
            for i in range(0, len(ids), FDS_PER_MESSAGE):
                message: dict[str, Any] = {"op": "fds", "ids": ids[i:i + FDS_PER_MESSAGE]}
                if owner is not None:
                    message["owner"] = owner
                reply, fds = self.request(message)
                out.extend(fds)
                if len(fds) != len(message["ids"]):
                    raise ValueError(f"asked for {len(message['ids'])} buffers, got "
                                     f"{len(fds)}: {reply.get('why', 'no reason given')}")
        except BaseException:
            for fd in out:
                os.close(fd)
            raise
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
