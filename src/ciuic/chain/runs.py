"""How runs end: clean exits, uncaught exceptions and termination signals, recorded so that the
next run of the job can say how the previous one was interrupted.

A run that was killed (SIGKILL, power loss, OOM killer) records nothing: its row keeps
``end_kind`` NULL, which the next run reads as a crash.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from ciuic.catalog.models import Run
from ciuic.format.manifest import parse_time


def was_interrupted(run: Run | None) -> bool:
    """Whether a previous run ended other than by finishing (close() or a normal exit)."""
    return run is not None and run.end_kind not in ("clean", "exit")


def describe_end(run: Run) -> str:
    kind = run.end_kind
    if kind is None:
        return "it was killed or crashed: no clean exit was recorded"
    if kind.startswith("signal:"):
        return f"it was stopped by {kind.split(':', 1)[1]}"
    if kind.startswith("exception:"):
        return f"it raised {kind.split(':', 1)[1]}"
    return "it exited cleanly"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def may_still_run(run: Run | None, recent_s: float = 30.0) -> bool:
    """Whether a previous run that recorded no end may still be alive: its process exists on
    this machine, or (elsewhere) it reported progress within ``recent_s`` seconds."""
    if run is None or run.end_kind is not None:
        return False
    if run.host == socket.gethostname():
        return pid_alive(run.pid)
    try:
        seen = parse_time(run.last_seen).timestamp()
    except ValueError:
        return False
    return time.time() - seen < recent_s


def identity() -> dict[str, str]:
    """Who we are, precisely enough to tell that a pid on "this machine" is ours to check:
    hostname, boot ID and PID namespace (containers may share a hostname, not the latter)."""
    ident = {"host": socket.gethostname(), "boot": "", "pidns": ""}
    try:
        ident["boot"] = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ident["pidns"] = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return ident



IDENTITY = identity()
