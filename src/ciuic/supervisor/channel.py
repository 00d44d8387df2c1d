"""The local channel between ``ciuic run`` and the training processes it supervises.

An abstract Unix socket (``SOCK_SEQPACKET``: one message per request, file descriptors passed
with ``SCM_RIGHTS``), named in ``CIUIC_SUPERVISOR``. Abstract names live in no file system, so a
supervisor that is killed leaves nothing behind. Messages are JSON; one too large for a packet
travels in a sealed ``memfd`` passed with it (:func:`send`).

Anyone on the machine can see an abstract name and connect to it, so the supervisor checks who
did: a process of another user is refused (``SO_PEERCRED``), and every connection opens with
:class:`~ciuic.supervisor.messages.Hello`: the secret of this start (``CIUIC_SUPERVISOR_KEY``,
in the environment of the workers only) and the rank the connection acts for from then on
(docs/architecture.md, "The channel").

The supervisor's end is :class:`ciuic.supervisor.holder.Holder`; a training process's is
:class:`Link`, through which it attaches (the heartbeat region, the host copy its rank left),
hands over its staging buffers (each a ``memfd`` the supervisor keeps open), publishes what they
hold after a commit, and maps the buffers of the node's other ranks (read-only) for a restore.
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
from ciuic.supervisor.messages import ProtocolError

log = logging.getLogger("ciuic")
ENV = "CIUIC_SUPERVISOR"
#: the secret of this start, which every connection must say first (set by ``ciuic run``)
KEY_ENV = "CIUIC_SUPERVISOR_KEY"
#: what ``ciuic run`` tells each restarted job of the start before it, through the job's
#: environment (set by the agent, read by ``manager/supervised.Restart``): the restart's
#: number, the cause's line, the last step() seen, the processes that stopped
RESTART_ENV = "CIUIC_RUN_RESTART"
CAUSE_ENV = "CIUIC_RUN_CAUSE"
STOPPED_AT_ENV = "CIUIC_RUN_STOPPED_AT"
PIDS_ENV = "CIUIC_RUN_PIDS"
_MAX_MESSAGE = 1 << 16
#: the largest message that travels in a memfd (a node's index of millions of chunks)
MAX_PAYLOAD = 1 << 28
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
    """The next message and its descriptors; (None, []) when the peer is gone. A message that
    is not a JSON object (or whose memfd does not hold what it says) is a
    :class:`~ciuic.supervisor.messages.ProtocolError`, its descriptors closed; the connection
    can go on."""
    data, fds, flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, FDS_PER_MESSAGE)
    fds = list(fds)
    if not data:
        _close(fds)
        return None, []
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ProtocolError(f"a message over {_MAX_MESSAGE} bytes or "
                                f"{FDS_PER_MESSAGE} descriptors")
        message = _decode(data)
        if set(message) == {_PAYLOAD} and fds:
            fd = fds.pop()
            try:
                message = _decode(_payload(fd, message[_PAYLOAD]))
            finally:
                os.close(fd)
    except BaseException:
        _close(fds)
        raise
    return message, fds


def _payload(fd: int, n: Any) -> bytes:
    """The ``n`` bytes of JSON at the start of memfd ``fd`` (read, not mapped: a memfd cut
    short meanwhile reads short, where a mapping would fault)."""
    if type(n) is not int or not 0 < n <= MAX_PAYLOAD:
        raise ProtocolError(f"a message in shared memory of {n!r} bytes (at most {MAX_PAYLOAD})")
    data = b""
    while len(data) < n:
        got = os.pread(fd, n - len(data), len(data))
        if not got:
            raise ProtocolError(f"a message in shared memory of {n} bytes whose memfd holds "
                                f"{len(data)}")
        data += got
    return data


def _decode(data: bytes) -> dict[str, Any]:
    try:
        message = json.loads(data)
    except RecursionError:
        raise ProtocolError("a message nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ProtocolError(f"a message that is not JSON ({e})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a JSON object, not {type(message).__name__}")
    return message


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# -- the training process's side ----------------------------------------------------------------


class Link:
    """A training process's connection to its supervisor, acting for ``rank`` (every call is
    thread-safe). It says :class:`~ciuic.supervisor.messages.Hello` first: a supervisor that
    refuses it raises :class:`PermissionError` with its reason."""

    def __init__(self, name: str, rank: int, secret: str, timeout: float = 30.0) -> None:
        self.name = name
        self.rank = rank
        self.secret = secret
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        try:
            self._sock.settimeout(timeout)
            self._sock.connect("\0" + name)
            reply, _ = self.request({"op": "hello", "secret": secret, "rank": rank})
        except BaseException:
            self.close()
            raise
        if not reply.get("ok"):
            self.close()
            raise PermissionError(f"the supervisor refused this process: {reply.get('why')}")

    @staticmethod
    def from_env() -> Link | None:
        """The link to the supervisor named in ``CIUIC_SUPERVISOR``; None when not under
        ``ciuic run`` (or when it cannot be reached, or refuses this process: logged, training
        goes on)."""
        name = os.environ.get(ENV)
        if not name:
            return None
        rank = int(os.environ.get("RANK", "0") or 0)
        try:
            return Link(name, rank, os.environ.get(KEY_ENV, ""))
        except (OSError, ValueError, ConnectionError) as e:
            log.warning("%s=%s is set but the supervisor cannot be reached (%s): no heartbeats "
                        "and no host-memory copy for this process", ENV, name, e)
            return None

    def request(self, message: dict[str, Any], fds: list[int] = ()  # type: ignore[assignment]
                ) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            send(self._sock, message, fds)
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
