"""SIGTERM and SIGINT: the first one asks for an emergency snapshot at the next ``step()`` (a
consistent point, after an optimizer update, never in the middle of one) and then an exit; a
second one exits at once. SIGUSR1 too where nothing else takes it (it would kill the process):
Slurm's usual preemption notice (``--signal=USR1@T``); under ``ciuic run`` the workers ignore
it and ``ciuic run`` passes SIGTERM on.

A signal that arrives soon after the first (:func:`same_within`) is the same request, not a
second one: Slurm signals every process of a job step, and torchrun (or ``ciuic run``) passes
on what it received, so a worker gets the one request two or three times within milliseconds.
SIGINT's window is short, :data:`SAME_SIGINT_WITHIN_S`: a second Ctrl-C is a person's, a few
hundred milliseconds or more after the first, and must stop the process at once.

The handler only sets a flag. It is installed from the main thread only; the handlers it
replaced are kept after :meth:`SignalGuard.restore`, because a closed guard's handler may still
be held by a later one's chain, and then passes signals on to them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

log = logging.getLogger("ciuic")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: taken only where its handler is the default (which kills the process)
IF_DEFAULT = (signal.SIGUSR1,)
#: a signal this soon after the first is the same request, sent by several (seconds)
SAME_WITHIN_S = 2.0
#: the same for SIGINT after SIGINT: a person's second Ctrl-C comes later than that
SAME_SIGINT_WITHIN_S = 0.3


def same_within(first: int, then: int) -> float:
    """Seconds after the signal ``first`` within which ``then`` is the same request."""
    if first == then == signal.SIGINT:
        return SAME_SIGINT_WITHIN_S
    return SAME_WITHIN_S


class SignalGuard:
    """Turns SIGTERM/SIGINT into :attr:`pending`; ``on_exit(kind)`` records a forced exit."""

    def __init__(self, on_exit: Callable[[str], None]) -> None:
        self._on_exit = on_exit
        #: the signal received (or agreed by every rank), not yet acted on
        self.pending: int | None = None
        #: multi-rank: the signal came from the agreement, so every rank stops at this step
        self.agreed = False
        self.closed = False
        self._prev: dict[int, Any] = {}
        self._first_at = 0.0

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (*SIGNALS, *IF_DEFAULT):
            prev = signal.getsignal(sig)
            if sig in IF_DEFAULT and prev != signal.SIG_DFL:
                continue
            self._prev[sig] = prev
            signal.signal(sig, self._on_signal)

    @property
    def name(self) -> str:
        assert self.pending is not None
        return signal.Signals(self.pending).name

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.closed:  # reached through another handler's chain: not ours any more
            _pass_on(_unchained(self._prev.get(signum, signal.SIG_DFL), signum), signum, frame)
            return
        name = signal.Signals(signum).name
        if (self.pending is not None
                and time.monotonic() - self._first_at < same_within(self.pending, signum)):
            return  # the same request, passed on by another process
        if self.pending is not None:  # a second signal: stop now
            self._on_exit(f"signal:{name}")
            self.restore()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.pending, self._first_at = signum, time.monotonic()
        log.warning("%s received: taking an emergency snapshot at the next step() and exiting "
                    "(%s to exit at once)", name,
                    "press Ctrl-C again" if signum == signal.SIGINT
                    else f"send {name} again, {SAME_WITHIN_S:g} s or more later,")

    def restore(self) -> None:
        """Put back the handlers ours replaced (where ours is still the installed one)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._prev.items():
            if signal.getsignal(sig) == self._on_signal:  # else a later guard's is on top
                signal.signal(sig, _unchained(handler, sig))

    def close(self) -> None:
        self.restore()
        self.closed = True


def _unchained(handler: Any, sig: int) -> Any:
    """``handler``, or for the handler of a closed guard the one it replaced (managers closed
    in another order than they were made leave no closed manager's handler installed)."""
    while (getattr(handler, "__func__", None) is SignalGuard._on_signal
           and handler.__self__.closed):
        handler = handler.__self__._prev.get(sig, signal.SIG_DFL)
    return handler


def _pass_on(handler: Any, signum: int, frame: FrameType | None) -> None:
    """Do what ``handler`` (a handler as ``signal.getsignal`` returns it) does for ``signum``."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL or handler is None:  # None: installed outside Python
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
