"""How runs end: clean exits, uncaught exceptions and termination signals, recorded so that the
next run of the job can say how the previous one was interrupted.

A run that was killed (SIGKILL, power loss, OOM killer) records nothing: its row keeps
``end_kind`` NULL, which the next run reads as a crash.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

from .catalog.models import Run
from .manifest import parse_time


class _Ends(Protocol):
    def _record_end(self, kind: str) -> None: ...


_live: weakref.WeakSet[Any] = weakref.WeakSet()
_prev_excepthook: Callable[..., Any] | None = None


def _excepthook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if not issubclass(tp, (SystemExit,)):
        for m in list(_live):
            m._record_end(f"exception:{tp.__name__}")
    hook = _prev_excepthook or sys.__excepthook__
    hook(tp, value, tb)


def _at_exit() -> None:
    for m in list(_live):
        m._record_end("exit")


def track(manager: _Ends) -> None:
    """Record ``manager``'s run end on uncaught exceptions and at interpreter exit."""
    global _prev_excepthook
    if _prev_excepthook is None:
        _prev_excepthook = sys.excepthook
        sys.excepthook = _excepthook
        atexit.register(_at_exit)
    _live.add(manager)


def untrack(manager: _Ends) -> None:
    _live.discard(manager)


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
