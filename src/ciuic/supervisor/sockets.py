"""This process's TCP sockets, read from ``/proc`` (Linux): which listen, and shutting down
the connections accepted on some of them (:func:`ciuic.supervisor.inprocess.abort_groups`: a gloo
collective blocked on a connection fails once its socket is shut down, on either end)."""

from __future__ import annotations

import contextlib
import os
import socket

_LISTEN = "0A"
_ESTABLISHED = "01"


def _inodes() -> dict[int, int]:
    """socket inode -> one of this process's descriptors for it."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                out.setdefault(int(target[8:-1]), int(fd))
    return out


def _tcp() -> dict[int, tuple[int, str]]:
    """socket inode -> (local port, state) of every TCP socket of this network namespace."""
    rows: dict[int, tuple[int, str]] = {}
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9:
                rows[int(fields[9])] = (int(fields[1].rsplit(":", 1)[1], 16), fields[3])
    return rows


def listening() -> set[int]:
    """The inodes of the TCP sockets this process listens on."""
    tcp = _tcp()
    return {i for i in _inodes() if tcp.get(i, (0, ""))[1] == _LISTEN}


def cut(before: set[int]) -> int:
    """Shut down every connection this process accepted on a socket it listens on that is not
    in ``before``; how many."""
    tcp, fds = _tcp(), _inodes()
    ports = {tcp[i][0] for i in fds if i in tcp and tcp[i][1] == _LISTEN and i not in before}
    done = 0
    for inode, fd in fds.items():
        port, state = tcp.get(inode, (0, ""))
        if state != _ESTABLISHED or port not in ports:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        if os.fstat(dup).st_ino != inode:  # the descriptor was closed and reused meanwhile
            os.close(dup)
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)
            continue
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
            done += 1
        sock.close()
    return done
