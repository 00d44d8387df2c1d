"""The supervisor's loop: start the command, watch it, tell why it stopped, restart it.

- A dead process is seen within :attr:`Options.poll_s` (0.1 s): the loop waits on the process,
  not on a log file.
- A hang is a rank that is alive, is not busy (restoring, saving, waiting for a write), and has
  made no ``step()`` for ``hang_timeout`` seconds, read from the heartbeat slots
  (:mod:`~ciuic.supervisor.beat`). It gets SIGTERM, then SIGKILL after ``grace`` seconds.
- SIGTERM, SIGINT or SIGHUP to the supervisor is passed on to the command's process group (under
  torchrun: to torchrun, which passes it to its workers, which take their emergency snapshot);
  the job is then not restarted. A second one kills the job at once.
- Restarts back off: the first after a start that committed a snapshot past the latest one
  (of the starts before) is immediate, then 1, 2, 4 ... seconds up to ``max_backoff``. After
  ``max_stalls`` failures in a row without such a snapshot, or ``max_restarts`` restarts, the
  supervisor gives up and says what failed. A start's last step() and commits are read from
  its heartbeat slots once more after it exits (a rank's slot keeps them after its manager
  closes), so a start shorter than a poll is seen whole.
- Each restart is told what happened through its environment: ``CIUIC_RUN_RESTART`` (the
  number), ``CIUIC_RUN_CAUSE`` (the cause's line), ``CIUIC_RUN_STOPPED_AT`` (the last step()
  seen) and ``CIUIC_RUN_PIDS`` (the processes that stopped), which the manager records in the
  catalog and prints in the recovery log.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType

from ciuic.supervisor import beat
from ciuic.supervisor.causes import Cause, OomWatch, classify, signal_name
from ciuic.supervisor.channel import (
    CAUSE_ENV,
    ENV,
    PIDS_ENV,
    RESTART_ENV,
    STOPPED_AT_ENV,
)
from ciuic.supervisor.holder import Holder
from ciuic.words import counted

log = logging.getLogger("ciuic.run")
TAIL_LINES = 60
_PR_SET_PDEATHSIG = 1


@dataclass
class Options:
    command: list[str]
    max_restarts: int = 10
    hang_timeout_s: float | None = 600.0
    #: seconds to wait for the first heartbeat of a start (None: no limit)
    startup_timeout_s: float | None = None
    grace_s: float = 30.0
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    max_stalls: int = 3
    #: the most bytes of host memory the snapshot copy may hold (None: no host-memory tier)
    host_memory: int | None = None
    poll_s: float = 0.1


@dataclass
class Start:
    """What one start of the command did, as the supervisor saw it."""

    number: int
    began: float
    pids: set[int] = field(default_factory=set)
    step: int | None = None  # the highest step() seen
    committed: int | None = None  # the highest committed step seen
    cause: Cause | None = None
    returncode: int | None = None
    hang_seen_s: float | None = None  # how long after the hang began it was detected


def _pdeathsig() -> None:
    """In the child: SIGTERM when the supervisor dies (it then takes its emergency snapshot;
    nothing is left running unsupervised)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Supervisor:
    """Runs :attr:`Options.command` until it succeeds, is stopped, or fails for good."""

    def __init__(self, options: Options) -> None:
        self.o = options
        self.starts: list[Start] = []
        self._stop: int | None = None  # the signal the supervisor received
        self._stops = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._wake = threading.Event()
        self.holder: Holder | None = None

    # -- signals -----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stops += 1
        self._stop = self._stop or signum
        self._wake.set()
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        if self._stops == 1:
            log.warning("ciuic run: %s received: passing it on to the job (it takes an "
                        "emergency snapshot and exits; it will not be restarted). Send it again "
                        "to kill the job at once.", signal_name(signum))
            _signal_group(proc.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)
        else:
            log.warning("ciuic run: %s again: killing the job", signal_name(signum))
            self._kill(proc, signal.SIGKILL)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        o = self.o
        self.holder = holder = Holder(o.host_memory)
        old = {s: signal.signal(s, self._on_signal)
               for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            return self._loop(holder)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            holder.close()

    def _loop(self, holder: Holder) -> int:
        o = self.o
        stalls = 0
        best_commit: int | None = None
        while True:
            start = Start(len(self.starts), time.monotonic())
            self.starts.append(start)
            rc = self._run_once(holder, start)
            start.returncode = rc
            if self._stop is not None:
                log.warning("ciuic run: the job exited (%s) after %s: not restarted",
                            _exit_text(rc), signal_name(self._stop))
                return _code(rc)
            if rc == 0 and start.cause is None:
                log.info("ciuic run: the job finished (exit 0)%s",
                         f" after {counted(start.number, 'restart')}" if start.number else "")
                return 0
            progress = start.committed is not None and (best_commit is None
                                                        or start.committed > best_commit)
            if progress:
                best_commit = start.committed
            stalls = 0 if progress else stalls + 1
            assert start.cause is not None
            where = (f"at step {start.step}" if start.step is not None
                     else "before its first step()")
            if stalls >= o.max_stalls or start.number >= o.max_restarts:
                new = ("a new snapshot" if best_commit is None
                       else f"a snapshot past step {best_commit}")
                why = (f"it failed {counted(stalls, 'time')} in a row without committing {new}"
                       if stalls >= o.max_stalls else
                       f"it was restarted {counted(start.number, 'time')}, the limit "
                       "(--max-restarts)")
                log.error("ciuic run: giving up: %s. The last failure, %s: %s%s", why, where,
                          start.cause, _tail_text(self._tail))
                return _code(rc) or 1
            delay = 0.0 if progress else min(o.max_backoff_s, o.backoff_s * 2 ** (stalls - 1))
            log.warning("ciuic run: the job stopped %s: %s. Restart %d of at most %d%s", where,
                        start.cause, start.number + 1, o.max_restarts,
                        f" in {delay:g} s" if delay else " now")
            if delay and self._wake.wait(delay):
                log.warning("ciuic run: %s received while waiting to restart: not restarted",
                            signal_name(self._stop or 0))
                return _code(rc)

    def _env(self) -> dict[str, str]:
        assert self.holder is not None
        env = dict(os.environ)
        env[ENV] = self.holder.name
        env[RESTART_ENV] = str(len(self.starts) - 1)
        for k in (CAUSE_ENV, STOPPED_AT_ENV, PIDS_ENV):
            env.pop(k, None)
        if len(self.starts) > 1:
            prev = self.starts[-2]
            env[CAUSE_ENV] = str(prev.cause)
            if prev.step is not None:
                env[STOPPED_AT_ENV] = str(prev.step)
            env[PIDS_ENV] = ",".join(map(str, sorted(prev.pids)))
        return env

    def _run_once(self, holder: Holder, start: Start) -> int:
        o = self.o
        holder.clear_beats()
        oom = OomWatch()
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        try:
            proc = subprocess.Popen(o.command, env=self._env(), stderr=subprocess.PIPE,
                                    start_new_session=True, preexec_fn=_pdeathsig)
        except OSError as e:
            start.cause = Cause("exit", f"exit: the command could not be started: {e}")
            log.error("ciuic run: cannot start %s: %s", o.command[0], e)
            self.o.max_stalls = 0  # the same next time: give up at once
            return 127
        self._proc = proc
        reader = threading.Thread(target=_forward, args=(proc, self._tail),
                                  name="ciuic-run-stderr", daemon=True)
        reader.start()
        if self._stop is not None:  # a signal arrived while it started
            _signal_group(proc.pid, signal.SIGTERM)
        hang: Cause | None = None
        while True:
            rc = proc.poll()
            if rc is not None:
                break
            now = time.monotonic()
            beats = beat.read(holder.beats)
            self._note(start, beats)
            if self._stop is None and hang is None:
                hang = self._hung(start, beats, now)
                if hang is not None:
                    log.warning("ciuic run: %s, detected %.2f s after its last sign of "
                                "training; stopping the job (SIGTERM, then SIGKILL after %g s)",
                                hang, start.hang_seen_s or 0.0, o.grace_s)
                    rc = self._terminate(proc, start)
                    break
            self._wake.wait(o.poll_s)
        reader.join(timeout=2.0)
        self._note(start, beat.read(holder.beats))
        self._proc = None
        start.cause = hang or (None if rc == 0 else classify(rc, list(self._tail), oom))
        return rc

    def _note(self, start: Start, beats: list[beat.Beat]) -> None:
        for b in beats:
            start.pids.add(b.pid)
            if b.step is not None and (start.step is None or b.step > start.step):
                start.step = b.step
            if b.committed is not None and (start.committed is None
                                            or b.committed > start.committed):
                start.committed = b.committed

    def _hung(self, start: Start, beats: list[beat.Beat], now: float) -> Cause | None:
        o = self.o
        if not beats:
            if o.startup_timeout_s is not None and now - start.began > o.startup_timeout_s:
                return Cause("hang", f"hang: no heartbeat within {o.startup_timeout_s:g} s of "
                                     "the start (--startup-timeout)")
            return None
        if o.hang_timeout_s is None:
            return None
        worst = max(beats, key=lambda b: b.silent_s(now))
        silent = worst.silent_s(now)
        if silent < o.hang_timeout_s:
            return None
        start.hang_seen_s = silent
        who = f"rank {worst.rank}, " if len(beats) > 1 or worst.rank else ""
        what = (f"no step() for {o.hang_timeout_s:g} s" if worst.step is not None else
                f"no first step() within {o.hang_timeout_s:g} s of its manager's start")
        return Cause("hang", f"hang: {what} ({who}pid {worst.pid})")

    def _terminate(self, proc: subprocess.Popen[bytes], start: Start) -> int:
        self._kill(proc, signal.SIGTERM, start.pids)
        try:
            return proc.wait(self.o.grace_s)
        except subprocess.TimeoutExpired:
            self._kill(proc, signal.SIGKILL, start.pids)
            return proc.wait()

    def _kill(self, proc: subprocess.Popen[bytes], sig: int,
              pids: set[int] | None = None) -> None:
        """``sig`` to the command's process group and to every rank that sent heartbeats
        (torchrun starts its workers in sessions of their own)."""
        _signal_group(proc.pid, sig)
        for pid in pids or (self.starts[-1].pids if self.starts else set()):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, sig)


def _forward(proc: subprocess.Popen[bytes], tail: collections.deque[str]) -> None:
    """Pass the command's stderr through, keeping its last lines."""
    assert proc.stderr is not None
    out = sys.stderr.buffer
    for line in iter(proc.stderr.readline, b""):
        try:
            out.write(line)
            out.flush()
        except (OSError, ValueError):
            pass
        tail.append(line.decode(errors="replace").rstrip("\n"))


def _tail_text(tail: collections.deque[str]) -> str:
    lines = [x for x in tail if x.strip()][-8:]
    return ("\n  | " + "\n  | ".join(lines)) if lines else ""


def _exit_text(rc: int) -> str:
    return f"killed by {signal_name(-rc)}" if rc < 0 else f"exit {rc}"


def _code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc
