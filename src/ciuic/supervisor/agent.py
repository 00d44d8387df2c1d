"""The supervisor's loop: start the command, watch it, tell why it stopped, restart it.

- A dead process is seen within :attr:`Options.poll_s` (0.1 s): the loop waits on the process,
  not on a log file.
- A hang is a rank that is alive, is not busy (restoring, saving, waiting for a write), and has
  made no ``step()`` for ``hang_timeout`` seconds, read from the heartbeat slots
  (:mod:`~ciuic.supervisor.beat`). It gets SIGTERM, then SIGKILL after ``grace`` seconds.
- SIGTERM, SIGINT or SIGHUP to the supervisor is passed on to the command's process group (under
  torchrun: to torchrun, which passes it to its workers, which take their emergency snapshot);
  the job is then not restarted. A second one kills the job at once. SIGUSR1 is a preemption
  notice (Slurm's ``--signal=USR1@T``, ``scancel --signal=USR1``): SIGTERM is passed on, and
  under Slurm the job is requeued once it exited (:func:`~ciuic.supervisor.slurm.requeue`).
  The command starts with SIGUSR1 ignored (Slurm signals every process of a step: torchrun
  would die of it, the workers with no snapshot); once it exited on a signal, the workers still
  finishing their snapshot (torchrun may exit first) are waited for, up to ``grace``.
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
import logging
import os
import signal
import subprocess
import threading
import time
from types import FrameType

from ciuic.supervisor import beat, slurm
from ciuic.supervisor.causes import (
    PEER_LOST,
    RAISED,
    WORKER_FAILED,
    Cause,
    OomWatch,
    classify,
    forward,
    signal_name,
)
from ciuic.supervisor.channel import (
    CAUSE_ENV,
    PIDS_ENV,
    RESTART_ENV,
    STOPPED_AT_ENV,
)
from ciuic.supervisor.holder import Holder
from ciuic.supervisor.procs import (
    exit_code,
    exit_text,
    pdeathsig,
    running,
    signal_group,
    stop_later,
    tail_text,
)
from ciuic.supervisor.starts import CAUSE_WAIT_S, Options, Start, snapshots_said
from ciuic.words import counted

log = logging.getLogger("ciuic.run")
TAIL_LINES = 60


class Supervisor:
    """Runs :attr:`Options.command` until it succeeds, is stopped, or fails for good."""

    def __init__(self, options: Options) -> None:
        self.o = options
        self.starts: list[Start] = []
        #: restarts so far, ciuic run's of the command and torchrun's of the workers (one
        #: numbering: the restarted run records it, ``ciuic log`` shows it)
        self.restarts = 0
        self._stop: int | None = None  # the signal the supervisor received
        self._stops = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._wake = threading.Event()
        self.holder: Holder | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        #: torchrun's lines for failed workers not yet told in a cause (_say_stopped)
        self._failed: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    # -- signals -----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stops += 1
        self._stop = self._stop or signum
        self._wake.set()
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        if self._stops == 1 and signum == signal.SIGUSR1:
            log.warning("ciuic run: SIGUSR1 received, a preemption notice: passing SIGTERM to "
                        "the job (it takes an emergency snapshot and exits; it will not be "
                        "restarted here%s)", "; Slurm will requeue it" if slurm.in_step(
                            os.environ) else "")
            signal_group(proc.pid, signal.SIGTERM)
        elif self._stops == 1:
            log.warning("ciuic run: %s received: passing it on to the job (it takes an "
                        "emergency snapshot and exits; it will not be restarted). Send it again "
                        "to kill the job at once.", signal_name(signum))
            signal_group(proc.pid, signal.SIGTERM if signum == signal.SIGHUP else signum)
        else:
            log.warning("ciuic run: %s again: killing the job", signal_name(signum))
            self._kill(proc, signal.SIGKILL)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        o = self.o
        self.holder = holder = Holder(o.host_memory, o.replicas, o.peer_timeout_s)
        old = {s: signal.signal(s, self._on_signal)
               for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)}
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
            said, failures = snapshots_said(self.starts)
            if self._stop is not None:
                self._wait_workers(start)
                said, failures = snapshots_said(self.starts)
                log.warning("ciuic run: the job exited (%s) after %s: not restarted. Its "
                            "snapshots: %s", exit_text(rc), signal_name(self._stop), said)
                if self._stop == signal.SIGUSR1:
                    requeued, words = slurm.requeue(os.environ)
                    if words:
                        (log.warning if requeued else log.error)("ciuic run: %s", words)
                return exit_code(rc)
            if rc == 0 and start.cause is None:
                log.log(logging.WARNING if failures else logging.INFO,
                        "ciuic run: the job finished (exit 0)%s. Its snapshots: %s",
                        f" after {counted(start.number, 'restart')}" if start.number else "",
                        said)
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
                log.error("ciuic run: giving up: %s. The last failure, %s: %s. Its "
                          "snapshots: %s%s", why, where, start.cause, said,
                          tail_text(self._tail))
                return exit_code(rc) or 1
            delay = 0.0 if progress else min(o.max_backoff_s, o.backoff_s * 2 ** (stalls - 1))
            self.restarts += 1  # (torchrun's restarts of the workers count too)
            mine = start.number + 1
            number = (f"{mine} of at most {o.max_restarts}" if self.restarts == mine else
                      f"{self.restarts} (the command's {mine} of at most {o.max_restarts})")
            log.warning("ciuic run: the job stopped %s: %s%s. Restart %s%s", where, start.cause,
                        "" if start.then is None else f" (then torchrun exited: {start.then})",
                        number, f" in {delay:g} s" if delay else " now")
            if delay and self._wake.wait(delay):
                log.warning("ciuic run: %s received while waiting to restart: not restarted",
                            signal_name(self._stop or 0))
                return exit_code(rc)

    def _env(self) -> dict[str, str]:
        assert self.holder is not None
        env = {**os.environ, **self.o.env}
        env.update(self.holder.new_start())  # the channel's name, this start's secret
        env[RESTART_ENV] = str(self.restarts)
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
        holder.restart = None  # this start's workers learn it from their environment
        oom = OomWatch()
        self._tail = collections.deque(maxlen=TAIL_LINES)
        self._failed = collections.deque(maxlen=TAIL_LINES)
        try:
            proc = subprocess.Popen(o.command, env=self._env(), stderr=subprocess.PIPE,
                                    start_new_session=True, preexec_fn=_in_child)
        except OSError as e:
            start.cause = Cause("exit", f"exit: the command could not be started: {e}")
            log.error("ciuic run: cannot start %s: %s", o.command[0], e)
            self.o.max_stalls = 0  # the same next time: give up at once
            return 127
        self._proc = proc
        reader = threading.Thread(target=forward, args=(proc, self._tail, self._failed),
                                  name="ciuic-run-stderr", daemon=True)
        reader.start()
        if self._stop is not None:  # a signal arrived while it started
            signal_group(proc.pid, signal.SIGTERM)
        hang: Cause | None = None
        while True:
            rc = proc.poll()
            if rc is not None:
                break
            now = time.monotonic()
            beats = beat.read(holder.beats)
            self._note(start, beats)
            alive = {b.pid for b in beats if running(b.pid)}  # once a poll: /proc reads
            if self._stop is None:
                self._workers(start, beats, alive, holder, now)
                silent = [b.silent_s(now) for b in beats
                          if b.pid not in start.stopping and b.busy != beat.BUSY[7]
                          and b.pid in alive]
                holder.silence = (max(silent, default=0.0), now)
            if self._stop is None and hang is None:
                hang = self._hung(start, beats, alive, now)
                if hang is None:
                    start.hang_pending = None
                if hang is not None and holder.peered() and not self._mine(start, holder, now):
                    hang = None  # another node's worker hangs, or it is told already
                elif hang is not None and holder.peered() and start.hung_pid is not None:
                    # several nodes: torchrun restarts every node's workers once this one is
                    # gone, and the others keep their rendezvous
                    log.warning("ciuic run: %s, detected %.2f s after its last sign of "
                                "training; stopping that worker (SIGTERM, then SIGKILL after "
                                "%g s): torchrun restarts the workers", hang,
                                start.hang_seen_s or 0.0, o.grace_s)
                    start.hang_cause, start.stopping = hang, start.stopping | {start.hung_pid}
                    holder.stopped_hang = now
                    stop_later(start.hung_pid, o.grace_s)
                    hang = None
                elif hang is not None:
                    log.warning("ciuic run: %s, detected %.2f s after its last sign of "
                                "training; stopping the job (SIGTERM, then SIGKILL after %g s)",
                                hang, start.hang_seen_s or 0.0, o.grace_s)
                    rc = self._terminate(proc, start)
                    break
            self._wake.wait(o.poll_s)
        reader.join(timeout=2.0)
        beats = beat.read(holder.beats)
        self._note(start, beats)
        self._proc = None
        start.cause = hang or (None if rc == 0 else classify(rc, list(self._tail), oom))
        first_cause(start, beats, holder.peered())
        return rc

    def _workers(self, start: Start, beats: list[beat.Beat], alive: set[int], holder: Holder,
                 now: float) -> None:
        """torchrun's own restarts of the workers (a job of several nodes): say why once per
        generation, naming the rank or the node; and stop this node's workers when another
        node's ciuic run has not answered for ``--peer-timeout`` (a link down: their
        collectives would wait far longer), so that torchrun restarts them."""
        found: dict[bool, tuple[str, str]] = {}

        def cause(earlier: bool = False) -> tuple[str, str]:
            """The current generation's first cause (``earlier``: that of the generation
            whose stop was said before its cause was known); read once a poll at most."""
            if earlier not in found:
                found[earlier] = self._worker_cause(beats, alive, holder, now, start.ranks,
                                                    self._lines(start, earlier))
            return found[earlier]

        alone = len(holder.trouble) + len(holder.peer_causes) == 0 and not holder.peered()
        for b in beats:
            pid, gen = start.workers.get(b.slot, (None, 0))
            if b.pid == pid or b.pid not in alive:
                continue
            if gen == start.generation and pid is not None:  # the next generation's first
                if not start.said:  # (a lost peer is not a cause: said when one arrives)
                    lost = cause()[1] == "lost" and not alone
                    self._say_stopped(start, holder, now, ("", "lost") if lost else cause())
                    if start.unknown is not None:  # kept for its cause, said later
                        start.unknown_lines = list(self._failed)
                self._failed.clear()  # the next generation's lines are its own
                found.clear()
                start.generation += 1
                self.restarts += 1  # counted once it happened (torchrun may exit instead)
                start.said, start.gone_since = False, None
                start.stopping, start.hang_pending, start.hung_pid = set(), None, None
            start.workers[b.slot] = (b.pid, start.generation)
            start.generation_of[b.pid] = start.generation
        # (a worker whose manager closed is done, not gone: its job finished)
        gone = [b for b in beats if start.workers.get(b.slot, (None,))[0] == b.pid
                and b.busy != beat.BUSY[7] and b.pid not in alive]
        if start.unknown is not None and not gone:  # (a cause now may be this generation's)
            self._late_cause(start, holder, now, cause(earlier=True))
        if gone and start.gone_since is None:
            start.gone_since = now
        if gone and not start.said:
            # torchrun logs a failed worker only once it stopped the others (SIGTERM, and their
            # emergency snapshot: seconds); a worker that exited with a status may have failed
            # in a collective because of another node's loss: give that node's cause (its ping
            # answer, each second) time to arrive; where the worker said it lost a peer, give
            # it the time the other node waits for its own (8 s) and more
            kind = "signal" if start.hang_cause is not None else cause()[1]
            waited = now - (start.gone_since or now)
            if (kind in ("node", "signal", "peer") or (kind in ("exit", "lost") and alone)
                    or (kind == "exit" and waited >= 8) or waited >= 30):
                self._say_stopped(start, holder, now, cause())
                self._failed.clear()  # told: the next generation's failures are its own
        for rank, (node, why, since) in list(holder.trouble.items()):
            live = [b.pid for b in beats if b.pid in alive]
            if (why.startswith("unreachable") and now - since >= self.o.peer_timeout_s
                    and rank not in start.cut_off and live):
                start.cut_off.add(rank)
                log.warning("ciuic run: node %d (%s) %s for %.0f s: stopping this node's "
                            "workers (their collectives would wait far longer); torchrun "
                            "restarts them", rank, node.host, why, now - since)
                for pid in live:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
        start.cut_off &= set(holder.trouble)  # a node that answers again may be cut off anew

    def _mine(self, start: Start, holder: Holder, now: float) -> bool:
        """Several nodes: whether the hang just detected is this node's to stop. Every rank
        that waits in a collective for a hung one falls silent too, on every node: the node
        whose worker has been silent longest stops it (each node's silence travels in its ping
        answers: waited for 1.5 s, two pings), and one stop per generation is enough. The
        others wait for torchrun's restart; up to one more ``--hang-timeout`` and ``--grace``
        (the stopping node's wait between SIGTERM and SIGKILL, before which no worker fails),
        then they act."""
        if start.stopping:
            return False  # this generation's hung worker is being stopped
        if start.hang_pending is None:
            start.hang_pending = now
        pending = now - start.hang_pending
        if pending < 1.5:
            return False
        silent, stopped = holder.other_hangs(now)
        patience = self.o.hang_timeout_s or 0.0
        if stopped is not None and stopped < patience + pending:
            # the other node's stop restarts everyone
            return pending >= 2 * patience + self.o.grace_s + 1.5
        mine = start.hang_seen_s or 0.0  # (as of now: _hung measured it this poll)
        return silent <= mine + 0.05 or pending >= patience + 1.5

    def _say_stopped(self, start: Start, holder: Holder, now: float,
                     found: tuple[str, str]) -> None:
        """Say why the current generation's workers stopped (``found``: the first cause and
        its kind, from :meth:`_worker_cause`)."""
        start.said = True
        where = f"at step {start.step}" if start.step is not None else "before its first step()"
        cause, kind = found
        if start.hang_cause is not None:  # this node stopped a hung worker: that is the cause
            cause, kind, start.hang_cause = str(start.hang_cause), "signal", None
        if kind in ("signal", "exit", "none") and cause:  # this node's: the others name it
            holder.cause = (cause, now)
        # the next generation's workers learn it when they attach (manager/supervised.Restart);
        # counted when they do (_workers): a torchrun without restarts left exits instead
        number = self.restarts + 1
        holder.restart = {"number": number, "cause": cause,
                          "stopped_at": start.step, "pids": sorted(
                              pid for pid, gen in start.workers.values()
                              if gen == start.generation)}
        if cause:
            start.told = (cause, start.generation)
        else:  # the next generation started first: it is said when it arrives
            start.unknown = (start.step, start.generation, now)
            cause = ("the cause is not known yet (this node's workers only lost their "
                     "connection to another rank; no word from another node yet)"
                     if kind == "lost" else
                     "the cause is not known yet (no failed worker in torchrun's output, no "
                     "dead worker seen, no word from another node)")
        left = self.o.worker_restarts
        if left is not None and start.generation > left:  # it exits: _loop restarts the job
            log.warning("ciuic run: the workers stopped %s: %s (torchrun has no restarts left: "
                        "--max-restarts %d)", where, cause, left)
        else:
            log.warning("ciuic run: the workers stopped %s: %s. torchrun restarts them "
                        "(generation %d), as restart %d", where, cause, start.generation + 1,
                        number)

    def _late_cause(self, start: Start, holder: Holder, now: float,
                    found: tuple[str, str]) -> None:
        """The cause of a generation's end that was not known when it was said, once it is
        (torchrun's line for a failed worker, another node gone or its word), or that it
        still is not after ``CAUSE_WAIT_S`` (then a worker that lost its peer is named, if
        one did)."""
        assert start.unknown is not None
        step, generation, since = start.unknown
        where = f"at step {step}" if step is not None else "before its first step()"
        cause, kind = found
        if kind in ("node", "signal", "peer", "exit") or (kind == "lost" and (
                now - since >= CAUSE_WAIT_S or not holder.peered())):
            start.unknown, start.unknown_lines = None, []  # told
            start.told = (cause, generation)
            if holder.restart is not None and not holder.restart.get("cause"):
                holder.restart["cause"] = cause  # for the workers that attach from now on
            if kind in ("signal", "exit"):
                holder.cause = (cause, now)
            log.warning("ciuic run: the cause of the workers' stop %s (the end of generation "
                        "%d): %s", where, generation, cause)
        elif now - since >= CAUSE_WAIT_S:
            start.unknown, start.unknown_lines = None, []
            log.warning("ciuic run: the cause of the workers' stop %s (the end of generation "
                        "%d) is still not known after %g s: torchrun named no failed worker, "
                        "and no other node named a cause", where, generation, CAUSE_WAIT_S)

    def _lines(self, start: Start, earlier: bool) -> list[str]:
        """The lines for failed workers and lost peers (:func:`forward`) of the current
        generation, or (``earlier``) of the one whose cause is not known yet: torchrun's line
        for a worker of an earlier generation may come after the next one started."""
        def older(line: str) -> bool:
            m = WORKER_FAILED.search(line)
            return m is not None and start.generation_of.get(int(m.group(3)),
                                                             start.generation) < start.generation
        if earlier:
            return start.unknown_lines + [x for x in self._failed if older(x)]
        return [x for x in self._failed if not older(x)]

    def _worker_cause(self, beats: list[beat.Beat], alive: set[int], holder: Holder, now: float,
                      seen: dict[int, int] | None = None, lines: list[str] | None = None
                      ) -> tuple[str, str]:
        """The first cause of a generation's end, and its kind: another node gone or cut off
        within the last 30 s ("node"), else a worker of this node killed by a signal sent to
        it ("signal"), else the cause another node gave in the last 30 s ("peer": a rank it
        lost; this node's workers then failed in a collective), else a worker's exit status
        or a signal it raised itself (SIGABRT, SIGSEGV...: torch's gloo aborts a process in
        its teardown after a collective failed because a peer died) from torchrun's line
        ("exit"), else the same of a worker whose exception said that its connection to
        another rank was lost ("lost": a consequence, whose cause is another node's to give),
        else the workers that are gone ("none"; the text is empty where none is: not known).
        ``seen``: the rank of each worker seen in this start, by pid (torchrun's line may come
        once a failed worker's heartbeat slot holds its successor); ``lines``: the lines for
        failed workers and lost peers to read (default: all of :attr:`_failed`)."""
        lines = list(self._failed) if lines is None else lines
        for _, (node, why, since) in sorted(holder.trouble.items()):
            if now - since < 30.0:
                return f"node {node.rank} ({node.host}): {why}", "node"
        ranks = {**(seen or {}), **{b.pid: b.rank for b in beats}}  # (seen: gone from beats)
        failed = sorted(((int(code), int(local), int(pid)) for code, local, pid
                         in WORKER_FAILED.findall("\n".join(lines))),
                        key=lambda f: f[0] >= 0)
        lost = {int(m.group(1)) for line in lines if (m := PEER_LOST.search(line))}
        named = [(f"rank {ranks[pid]}" if pid in ranks else f"local rank {local}", code,
                  ranks.get(pid) in lost) for code, local, pid in failed]
        sent = [(who, code) for who, code, _ in named if code < 0 and -code not in RAISED]
        if sent:
            return f"{sent[0][0]}: {signal_name(-sent[0][1])} (killed)", "signal"
        for _, (node, said, at) in sorted(holder.peer_causes.items()):
            if now - at < 30.0:
                return f"node {node.rank} ({node.host}): {said}", "peer"
        if named:
            # not a consequence first, then an exit status before a signal raised (stable)
            who, code, consequence = min(named, key=lambda n: (n[2], n[1] < 0))
            what = f"{signal_name(-code)} (killed)" if code < 0 else f"exit status {code}"
            if consequence:
                return f"{who}: {what} after its connection to another rank was lost", "lost"
            return f"{who}: {what}", "exit"
        dead = [b for b in beats if b.pid not in alive]
        return ", ".join(f"rank {b.rank} (pid {b.pid}) exited" for b in dead), "none"

    def _note(self, start: Start, beats: list[beat.Beat]) -> None:
        start.note(beats)

    def _hung(self, start: Start, beats: list[beat.Beat], alive: set[int], now: float
              ) -> Cause | None:
        o = self.o
        # torchrun restarts dead workers itself; one being stopped for a hang is told already
        beats = [b for b in beats if b.pid in alive and b.pid not in start.stopping]
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
        start.hang_seen_s, start.hung_pid = silent, worst.pid
        who = f"rank {worst.rank}, " if len(beats) > 1 or worst.rank else ""
        what = (f"no step() for {o.hang_timeout_s:g} s" if worst.step is not None else
                f"no first step() within {o.hang_timeout_s:g} s of its manager's start")
        return Cause("hang", f"hang: {what} ({who}pid {worst.pid})")

    def _wait_workers(self, start: Start) -> None:
        """After a stop by signal: the workers that still run (torchrun exited before them, a
        second signal from the scheduler cut its wait short) finish their emergency snapshot,
        for up to ``grace`` seconds; their last heartbeats are then read once more."""
        end = time.monotonic() + self.o.grace_s
        while time.monotonic() < end and any(running(pid) for pid in start.pids):
            time.sleep(self.o.poll_s)
        if self.holder is not None:
            self._note(start, beat.read(self.holder.beats))

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
        signal_group(proc.pid, sig)
        for pid in pids or (self.starts[-1].pids if self.starts else set()):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


def _in_child() -> None:
    """In the command's process: die with the supervisor, and ignore SIGUSR1 (the supervisor
    acts on it; the ignored disposition passes to torchrun and its workers)."""
    pdeathsig()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def first_cause(start: Start, beats: list[beat.Beat], peered: bool) -> None:
    """The cause of a start of several nodes (``peered``) that ended before any worker of a
    generation after the one whose end was said made a step() is that generation's: torchrun's
    exit that followed (its agents' rendezvous failing, its restarts used up) is a consequence
    (``start.then``), and every node named the first cause already."""
    if (start.cause is not None and start.told is not None and peered
            and not any(b.step is not None and start.generation_of.get(b.pid, 0)
                        > start.told[1] for b in beats)):
        start.then, start.cause = start.cause, Cause("generation", start.told[0])
