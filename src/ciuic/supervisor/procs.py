"""The supervisor's dealings with processes: whether one runs, signals to it and its group,
its end in words (:mod:`ciuic.supervisor.agent`)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import threading
import time

from ciuic.supervisor.causes import signal_name

_PR_SET_PDEATHSIG = 1


def pdeathsig() -> None:
    """In the child: SIGTERM when the supervisor dies (it then takes its emergency snapshot;
    nothing is left running unsupervised)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_later(pid: int, grace_s: float) -> None:
    """SIGTERM to ``pid`` now, SIGKILL after ``grace_s`` if it still runs (on a thread: the
    supervisor keeps polling meanwhile)."""
    def stop() -> None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + grace_s
        while time.monotonic() < end and running(pid):
            time.sleep(0.1)
        if running(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    threading.Thread(target=stop, name="ciuic-run-stop", daemon=True).start()


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its parent does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, sig)


def tail_text(tail: collections.deque[str]) -> str:
    lines = [x for x in tail if x.strip()][-8:]
    return ("\n  | " + "\n  | ".join(lines)) if lines else ""


def exit_text(rc: int) -> str:
    return f"killed by {signal_name(-rc)}" if rc < 0 else f"exit {rc}"


def exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc
