"""``ciuic run --nproc-per-node N``: ciuic run starts the ranks itself and recovers from a
rank's fault in the survivors' processes (:mod:`ciuic.supervisor.inprocess`, docs/recovery.md).

torchrun stops every worker when one fails; here only the failed rank's process is replaced:

- The ranks get torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``), so that
  ``init_process_group()`` works as under torchrun, and ``CIUIC_INPROCESS``, the job's control
  store, which this process hosts (it outlives every rank).
- A fault is a rank that died (its exit status says how), one that raised and reported it
  through the control store (it stays in its process), or one that hangs (no ``step()`` for
  ``--hang-timeout``: it is killed). Each opens the next generation: a fresh rendezvous store
  (torch's keys of the last group are never found again), a new process for each dead rank
  (or a warm spare, ``--spares K``, started ahead with its imports done), and the cause, which
  every rank's manager records. The survivors' wrappers see it and call the training
  function again.
- As ``ciuic run`` over torchrun: host memory (the staging buffers of every rank, kept across
  the generations and across a rank's death), the heartbeats, give up after ``--max-stalls``
  faults in a row without a new snapshot or ``--max-restarts`` in all (the ranks are told to
  stop: each re-raises its error), SIGTERM passed on to every rank.

On several nodes (``--nnodes M --node-rank K --master-addr A --master-port P``, one ``ciuic
run`` per node) node 0 leads (:mod:`ciuic.supervisor.fleet`): it hosts the control store and
the rendezvous stores and opens each generation; every node starts, watches and replaces its
own ranks (:mod:`ciuic.supervisor.follow`), and a lost node's ranks go to a spare node.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from types import FrameType
from typing import Any

from ciuic.errors import ConfigurationError
from ciuic.supervisor import beat
from ciuic.supervisor import inprocess as ip
from ciuic.supervisor.causes import Cause, OomWatch, classify, forward, signal_name
from ciuic.supervisor.fleet import LINK, LeaderLink, Member, NodeSpec
from ciuic.supervisor.holder import Holder
from ciuic.supervisor.leading import FOLLOWERS_WAIT_S, Leading
from ciuic.supervisor.procs import exit_code, exit_text, pdeathsig, tail_text
from ciuic.supervisor.starts import Options, Start, snapshots_said
from ciuic.words import counted, listed

log = logging.getLogger("ciuic.run")
POLL_S = 0.05
#: after a hang, how long the ranks have to leave the generation before those that did not
#: are killed as stuck (a rank blocked in a collective leaves within milliseconds)
STUCK_S = 3.0
#: a fault reported as a lost connection: how long a rank's death (its likely cause) is waited
DEATH_WAIT_S = 1.0
#: warm spares that may die before ciuic run starts no more
SPARE_DEATHS = 3
#: a collective's error when a peer is gone
LOST = re.compile(r"Connection (?:closed|reset|refused)|Broken pipe|recv.*0 bytes|DistNetworkError|"
                  r"DistBackendError|remote process exited|NCCL|[Tt]imed? ?out")


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    rank: int | None  # None: a spare not yet given a place
    spare: str | None = None  # its name: a number, "NODE-NUMBER" on several nodes
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=60))
    failed: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=60))
    done: bool = False
    since: int = 0  # the generation it took its rank in


class Launcher(Leading):
    """Starts ``nproc`` ranks of :attr:`Options.command` and keeps the job going."""

    def __init__(self, options: Options, nproc: int, spares: int = 0,
                 spec: NodeSpec | None = None) -> None:
        self.o = options
        self.nproc = nproc
        self.spares = spares
        #: the job's nodes (None: this one alone); this node's slot among them (the ranks
        #: ``slot * nproc ...`` are its own; None: a spare node not given a place yet)
        self.spec = spec
        self.nnodes = spec.nnodes if spec is not None else 1
        self.world = nproc * self.nnodes
        self.slot: int | None = None if spec is not None and spec.spare else (
            spec.node_rank if spec is not None else 0)
        self.link: LeaderLink | None = None
        #: how this node's warm spares are named (None: by number alone, on one node)
        self.spare_prefix: str | None = None if spec is None else str(spec.node_rank)
        self._full = 0  # the recoveries that were full restarts (an unwrapped training)
        #: slots whose node was lost and that no node has taken yet (slot -> its generation)
        self._vacant: dict[int, int] = {}
        self.gen = 0
        self.workers: list[Worker] = []
        self.starts: list[Start] = []
        self._spare_ids = 0
        self._spare_deaths = 0
        self._all_done = False
        self._stop: int | None = None
        self._stopped_at = 0.0
        self._stops = 0
        self._wake = threading.Event()
        self._stores: list[Any] = []  # the current generation's rendezvous store
        self.control: Any = None
        self.holder: Holder | None = None
        self._env: dict[str, str] = {}
        #: after a hang: the hung generation, and when the ranks still in it are killed
        self._stuck: tuple[int, float] | None = None

    # -- signals -----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stops += 1
        if self._stop is None:
            self._stop, self._stopped_at = signum, time.monotonic()
        self._wake.set()
        sig = signal.SIGKILL if self._stops > 1 else (
            signal.SIGTERM if signum in (signal.SIGHUP, signal.SIGUSR1) else signum)
        if self._stops == 1:
            log.warning("ciuic run: %s received: passing %s to every rank (each takes its "
                        "emergency snapshot and exits; not restarted). Send it again to kill "
                        "the job at once.", signal_name(signum), signal_name(sig))
        for w in self._live():
            with contextlib.suppress(OSError):
                os.kill(w.proc.pid, sig)

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> int:

        o, spec = self.o, self.spec
        self.holder = Holder(o.host_memory, o.replicas if spec is not None else 0,
                             o.peer_timeout_s)
        addr = spec.master_addr if spec is not None else "127.0.0.1"
        self.control = self._control_store()
        # NCCL's watchdog would tear a rank down on a peer's fault; here the rank's wrapper
        # aborts its communicators instead (torch: _abort_process_group wants it off)
        self._env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", **os.environ, **o.env,
                     **self.holder.environment(),
                     ip.ENV: f"{addr}:{self.control.port}", "MASTER_ADDR": addr,
                     "WORLD_SIZE": str(self.world), "LOCAL_WORLD_SIZE": str(self.nproc),
                     "GROUP_RANK": str(self.slot or 0), "GROUP_WORLD_SIZE": str(self.nnodes),
                     "ROLE_RANK": str(self.slot or 0), "TORCHELASTIC_USE_AGENT_STORE": "True"}
        if spec is not None:
            self._env[ip.NODE_ENV] = str(spec.node_rank)
        old = {s: signal.signal(s, self._on_signal)
               for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)}
        try:
            self._begin()
            if self.slot is not None:
                for local in range(self.nproc):
                    self._spawn(self.slot * self.nproc + local)
            for _ in range(self.spares):
                self._spawn(None)
            return self._loop()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self._end_all()
            self.holder.close()
            if self.link is not None:
                self.link.close()

    def _control_store(self) -> Any:
        """The job's control store, hosted here (``--master-port`` on several nodes)."""
        from torch._C._distributed_c10d import TCPStore

        port = self.spec.master_port if self.spec is not None else 0
        try:
            return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=30))
        except RuntimeError as e:  # (torch's DistNetworkError)
            raise ConfigurationError(
                f"node 0 cannot host the job's control store on port {port}: "
                f"{str(e).splitlines()[0]}. Is another job (or a ciuic run left from one) "
                "using it? Give every node another --master-port.") from None

    def _begin(self) -> None:
        """The first generation opened; on several nodes the node link listens first."""
        if self.spec is not None:
            self.link = LeaderLink(self.o.peer_timeout_s)
            self.control.set(LINK, str(self.link.port))
            self.control.set(ip.SLOT + "0", "0")
            self._vacant = dict.fromkeys(range(1, self.nnodes), -1)  # -1: the node of that rank
        self._open(None, None)

    def _open(self, cause: Cause | None, stopped: int | None) -> None:
        """Open the next generation: its rendezvous store, its cause; the ranks wait for its
        port (set last)."""
        from torch._C._distributed_c10d import TCPStore

        if self.starts:
            self.gen += 1
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))
        # the last generation's store is closed: a rank still waiting in it (forming a group
        # with a rank that died meanwhile) fails at once instead of after its timeout
        self._stores.clear()
        self._stores.append(store)
        g = str(self.gen)
        if cause is not None:
            self.control.set(ip.CAUSE + g, cause.text)
        if stopped is not None:
            self.control.set(ip.STOPPED + g, str(stopped))
        self.control.set(ip.GEN, g)
        self.control.set(ip.PORT + g, str(store.port))
        self.starts.append(Start(self.gen, time.monotonic()))

    def _spawn(self, rank: int | None) -> Worker:
        # MASTER_PORT: the generation's rendezvous store, for a script that is not wrapped in
        # ciuic.recoverable (the wrapper sets it again at each generation)
        env = dict(self._env, TORCHELASTIC_RESTART_COUNT=str(self.gen),
                   CIUIC_RUN_RESTART=str(self.gen),
                   MASTER_PORT=self.control.get(ip.PORT + str(self.gen)).decode())
        for key, name in ((ip.CAUSE, "CIUIC_RUN_CAUSE"), (ip.STOPPED, "CIUIC_RUN_STOPPED_AT")):
            if self.gen and self.control.check([key + str(self.gen)]):  # (as the wrapper does)
                env[name] = self.control.get(key + str(self.gen)).decode()
        spare = None
        if rank is None:
            # one name in the control store: of this node, and of this start of its ciuic run
            spare = (str(self._spare_ids) if self.spare_prefix is None
                     else f"{self.spare_prefix}-{self._spare_ids}")
            self._spare_ids += 1
            env[ip.SPARE_ENV] = spare
            for k in ("RANK", "LOCAL_RANK"):
                env.pop(k, None)
        else:
            env["RANK"], env["LOCAL_RANK"] = str(rank), str(rank % self.nproc)
            env["GROUP_RANK"] = env["ROLE_RANK"] = str(rank // self.nproc)
        proc = subprocess.Popen(self.o.command, env=env, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=_in_child)
        w = Worker(proc, rank, spare, since=self.gen)
        threading.Thread(target=forward, args=(proc, w.tail, w.failed),
                         name="ciuic-run-stderr", daemon=True).start()
        self.workers.append(w)
        return w

    def _live(self) -> list[Worker]:
        return [w for w in self.workers if w.proc.poll() is None]

    def _loop(self) -> int:
        o = self.o
        assert self.holder is not None
        oom = OomWatch()
        stalls = 0
        best: int | None = None
        handled = -1  # the last generation whose fault was acted on
        while True:
            start = self.starts[-1]
            beats = beat.read(self.holder.beats)
            start.note([b for b in beats if b.busy != beat.BUSY[7] or b.commits])
            ranks = [w for w in self.workers if w.rank is not None and not w.done]
            dead: list[tuple[Worker, int]] = []
            for w in ranks:
                rc = w.proc.poll()
                if rc == 0:
                    w.done = True
                elif rc is not None:
                    dead.append((w, rc))
            self._spares_alive()
            if self._stop is not None:
                # the ranks take their emergency snapshot (STOP now would make their watchers
                # abort it); past --grace, a rank still waiting for a generation gives up, and
                # one still running is killed
                late = time.monotonic() - self._stopped_at
                if late >= o.grace_s and not self.control.check([ip.STOP]):
                    self.control.set(ip.STOP, f"ciuic run received {signal_name(self._stop)}")
                if late >= o.grace_s + 2.0:
                    for w in ranks:
                        with contextlib.suppress(OSError):
                            os.kill(w.proc.pid, signal.SIGKILL)
                if not ranks or all(w.proc.poll() is not None for w in ranks):
                    return self._stopped()
            elif all(w.done for w in self.workers if w.rank is not None):
                return self._finished()
            else:
                if not self._all_done and all(self.control.check(
                        [f"{ip.DONE}{self.gen}/{r}"]) for r in range(self.world)):
                    self._all_done = True  # every rank's function returned: they may exit
                    self.control.set(ip.FINISHED, str(self.gen))
                if self._stuck is not None and time.monotonic() >= self._stuck[1]:
                    self._kill_stuck(ranks)
                self._fill_vacant()
                fresh = self.gen > handled
                reported = fresh and int(self.control.add(ip.FAULTS + str(self.gen), 0)) > 0
                hung = self._hung(beats, ranks) if self._stuck is None else None
                if reported and not dead:
                    dead = self._dead_too(ranks)
                lost = self._lost_nodes() if not self._all_done else []
                elsewhere = self._elsewhere(hung) if fresh else None
                if dead or reported or hung is not None or lost or elsewhere is not None:
                    cause = hung or elsewhere or self._cause(dead, oom, lost)
                    handled = self.gen
                    progress = start.committed is not None and (best is None
                                                                or start.committed > best)
                    if progress:
                        best = start.committed
                    stalls = 0 if progress else stalls + 1
                    fatal = self.control.check([ip.FATAL + str(self.gen)])
                    if fatal or stalls >= o.max_stalls or self.gen >= o.max_restarts:
                        return self._give_up(cause, stalls, best, dead, fatal)
                    self._recover(cause, start, dead, lost)
                    if cause.kind == "hang":  # who does not leave the generation is stuck
                        self._stuck = (self.gen - 1, time.monotonic() + STUCK_S)
            self._wake.wait(POLL_S)

    def _dead_too(self, ranks: list[Worker]) -> list[tuple[Worker, int]]:
        """A rank reported a fault and none is seen dead: when the first report is a lost
        connection, a rank that died is its likely cause, and its exit is waited for a
        moment (else the next generation would wait for it)."""
        end = time.monotonic() + (DEATH_WAIT_S if self._lost_connection() else 0.0)
        while True:
            dead = [(w, rc) for w in ranks if (rc := w.proc.poll()) not in (None, 0)]
            if dead or time.monotonic() >= end or self._known_elsewhere():
                return dead
            time.sleep(0.01)

    def _lost_connection(self) -> bool:
        first = self._reports()
        return bool(first) and bool(LOST.search(min(first)[2]))

    def _reports(self) -> list[tuple[int, int, str]]:
        """(order, rank, text) of each fault reported in the current generation."""
        keys = [f"{ip.FAULT}{self.gen}/{k}" for k in range(self.world)]
        end = time.monotonic() + 1.0  # the count is added before the text is set
        while not (said := [k for k in keys if self.control.check([k])]) and (
                time.monotonic() < end):
            time.sleep(0.01)
        out = []
        for k in said:
            order, _, text = self.control.get(k).decode().partition(" ")
            out.append((int(order), int(k.rsplit("/", 1)[1]), text))
        return out

    def _spares_alive(self) -> None:
        """A spare that died is replaced, :data:`SPARE_DEATHS` times at most (a script that
        fails before the wrapped function would fail every spare)."""
        for w in self.workers:
            if w.rank is None and not w.done and w.proc.poll() is not None:
                w.done = True
                self._spare_deaths += 1
                if self._stop is not None:
                    continue
                if self._spare_deaths > SPARE_DEATHS:
                    log.error("ciuic run: warm spare %s exited (%s), the %d-th: no more spares "
                              "(does the script fail before its recoverable function? its "
                              "stderr is above)%s", w.spare, exit_text(w.proc.returncode),
                              self._spare_deaths, tail_text(w.tail))
                    self.spares = 0
                    continue
                log.warning("ciuic run: warm spare %s exited (%s): starting another",
                            w.spare, exit_text(w.proc.returncode))
                self._spawn(None)

    def _finished(self) -> int:
        self.control.set(ip.STOP, "the job finished")
        said, failures = snapshots_said(self.starts)
        log.log(logging.WARNING if failures else logging.INFO,
                "ciuic run: the job finished (exit 0)%s. Its snapshots: %s",
                f" after {self._recoveries_text()}" if self.gen else "", said)
        return 0

    def _hung(self, beats: list[beat.Beat], ranks: list[Worker]) -> Cause | None:
        """A hang: a rank training (not restoring, saving, closing) and silent past
        ``--hang-timeout``. Which rank hangs is not known from here (the ranks waiting for it
        in a collective are silent too): every rank is told to leave the generation, and the
        ones that do not within :data:`STUCK_S` are killed (:meth:`_kill_stuck`)."""
        timeout = self.o.hang_timeout_s
        now = time.monotonic()
        pids = {w.proc.pid for w in ranks if w.proc.poll() is None}
        live = [b for b in beats if b.pid in pids and b.busy is None]
        if timeout is None or not live:
            return None
        worst = max(live, key=lambda b: b.silent_s(now))
        if worst.silent_s(now) < timeout:
            return None
        what = (f"no step() for {timeout:g} s" if worst.step is not None else
                f"no first step() within {timeout:g} s of its manager's start")
        return Cause("hang", f"hang: {what} (rank {worst.rank} the longest silent)")

    def _kill_stuck(self, ranks: list[Worker]) -> None:
        """The ranks that did not leave the hung generation: killed, and replaced."""
        assert self._stuck is not None
        gen = self._stuck[0]
        self._stuck = None
        # (a rank that took its place after the hang was not in that generation; one that left
        # it reported a fault there, or in a later one it went on to)
        stuck = [w for w in ranks if w.proc.poll() is None and w.since <= gen
                 and not any(self.control.check([f"{ip.FAULT}{g}/{w.rank}"])
                             for g in range(gen, max(gen + 1, self.gen)))]
        for w in stuck:
            with contextlib.suppress(OSError):
                os.kill(w.proc.pid, signal.SIGKILL)
            w.proc.wait()
            w.done = True
        if stuck:
            how = self._replace(sorted(w.rank for w in stuck if w.rank is not None))
            log.warning("ciuic run: hung: %s did not leave generation %d within %g s: killed; "
                        "%s", listed([w.rank for w in stuck], "rank"), gen, STUCK_S,
                        ", ".join(how))

    def _cause(self, dead: list[tuple[Worker, int]], oom: OomWatch,
               lost: list[Member] | None = None) -> Cause:
        if lost:
            m = lost[0]
            who = (f"node {m.slot}" if m.node_rank == m.slot else
                   f"node {m.node_rank}, which held node {m.slot}'s ranks,")
            return Cause("node", f"{who} ({m.host}) lost: {m.lost}")
        if dead:
            w, rc = dead[0]
            c = classify(rc, list(w.tail), oom)
            return Cause(c.kind, f"rank {w.rank} (pid {w.proc.pid}): {c.text}")
        faults = self._reports()
        if not faults:
            return Cause("exception", "exception: a rank reported a fault")
        _, rank, text = min(faults)
        return Cause("exception", f"exception: rank {rank}: {text}")

    def _recover(self, cause: Cause, start: Start, dead: list[tuple[Worker, int]],
                 nodes: list[Member] | None = None) -> None:
        # a rank that finished (its function returned) is started again too: the generation
        # needs every rank, and it restores the last snapshot and finishes again
        finished = [w for w in self.workers if w.rank is not None and w.done
                    and w.proc.returncode == 0 and self._latest(w.rank) is w]
        lost = sorted({w.rank for w, _ in dead if w.rank is not None}
                      | {w.rank for w in finished if w.rank is not None})
        for w, _ in dead:
            w.done = True
        elsewhere = self._died_elsewhere()
        where = f"at step {start.step}" if start.step is not None else "before its first step()"
        full = not all(self.control.check([ip.WRAPPED + str(r)]) for r in range(self.world))
        if full:  # a rank's training is not in ciuic.recoverable: no rank can stay
            self._full += 1
            self.control.set(ip.FULL + str(self.gen + 1), cause.text)
            lost = sorted(set(lost) | set(self._end_local_ranks()))
        for m in nodes or ():  # before the generation opens: the lost node's ranks may be
            # alive, cut off; seen again, this tells them (and its ciuic run) they are out
            self.control.set(ip.SLOT + str(m.slot), ip.NO_NODE)
        self._open(cause, start.step)
        how = self._replace(lost)
        for m in nodes or ():
            assert m.slot is not None
            self._vacant[m.slot] = self.gen
            how.append(f"node {m.slot}'s ranks ({self._ranks_text(m.slot)}) go to the next "
                       "node to join (a spare node)")
            elsewhere |= set(range(m.slot * self.nproc, (m.slot + 1) * self.nproc))
        stay = self.world - len(lost) - len(elsewhere)
        if full:
            log.warning("ciuic run: %s %s. Generation %d: a full restart (every rank a new "
                        "process%s): %s not in a function wrapped in ciuic.recoverable, so no "
                        "rank can stay in its process (docs/recovery.md)%s", cause.text, where,
                        self.gen, ", every node" if self.link is not None else "",
                        "a rank's training is" if self.world > 1 else "the training is",
                        f"; {', '.join(how)}" if how else "")
        elif cause.kind == "hang":
            log.warning("ciuic run: %s %s. Generation %d: every rank leaves generation %d; one "
                        "that has not within %g s is hung, and is killed and replaced",
                        cause.text, where, self.gen, self.gen - 1, STUCK_S)
        else:
            log.warning("ciuic run: %s %s. Generation %d: %s %s%s",
                        cause.text, where, self.gen, counted(stay, "rank"),
                        "stays in its process" if stay == 1 else "stay in their processes",
                        f"; {', '.join(how)}" if how else "")
        self._fill_vacant()

    def _recoveries_text(self) -> str:
        if not self._full:
            return counted(self.gen, "in-process recovery", "in-process recoveries")
        return (f"{counted(self.gen, 'recovery', 'recoveries')} ("
                f"{counted(self._full, 'full restart')}: the training is not in "
                "ciuic.recoverable)")

    def _end_local_ranks(self) -> list[int]:
        """A full restart: this node's ranks still running, SIGKILLed (as torchrun ends a
        node's workers); their ranks."""
        ended = []
        for w in self.workers:
            if w.rank is not None and not w.done and w.proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.kill(w.proc.pid, signal.SIGKILL)
                w.proc.wait()
                w.done = True
                ended.append(w.rank)
        return ended

    def _local_ranks(self) -> range:
        """This node's ranks (none: a spare node without a place)."""
        if self.slot is None:
            return range(0)
        return range(self.slot * self.nproc, (self.slot + 1) * self.nproc)

    def _mine(self) -> list[Worker]:
        """The last process of each of this node's ranks."""
        return [w for r in self._local_ranks() if (w := self._latest(r)) is not None]

    def _latest(self, rank: int) -> Worker | None:
        """The last process started for ``rank``."""
        return next((w for w in reversed(self.workers) if w.rank == rank), None)

    def _replace(self, lost: list[int]) -> list[str]:
        """A process for each lost rank in the current generation: a warm spare where one is
        ready (another is started in its place), else a new one."""
        spares = [w for w in self.workers if w.rank is None and w.proc.poll() is None]
        how = []
        for rank in lost:
            if spares:
                s = spares.pop(0)
                s.rank, s.since = rank, self.gen
                self.control.set(ip.ASSIGN + str(s.spare),
                                 f"{rank} {self.gen} {rank % self.nproc} {rank // self.nproc}")
                how.append(f"rank {rank} goes to warm spare {s.spare}")
                if self.spares:
                    self._spawn(None)  # keep --spares ready
            else:
                self._spawn(rank)
                how.append(f"rank {rank} starts anew")
        return how

    def _give_up(self, cause: Cause, stalls: int, best: int | None,
                 dead: list[tuple[Worker, int]], fatal: bool = False) -> int:
        o = self.o
        new = "a new snapshot" if best is None else f"a snapshot past step {best}"
        why = ("a configuration error, which recovering would meet again" if fatal else
               f"it failed {counted(stalls, 'time')} in a row without committing {new}"
               if stalls >= o.max_stalls else
               f"it recovered {counted(self.gen, 'time')}, the limit (--max-restarts)")
        self.control.set(ip.STOP, f"ciuic run gave up: {why}")
        end = time.monotonic() + o.grace_s
        while time.monotonic() < end and self._live():
            time.sleep(0.05)
        said, _ = snapshots_said(self.starts)
        tail = dead[0][0].tail if dead else collections.deque()
        log.error("ciuic run: giving up: %s. The last failure: %s. Its snapshots: %s%s", why,
                  cause, said, tail_text(tail))
        rc = first_failure(self._mine())
        return exit_code(rc) if rc else 1

    def _stopped(self) -> int:
        said, _ = snapshots_said(self.starts)
        rc = first_failure(self._mine())
        log.warning("ciuic run: the job exited (%s) after %s: not restarted. Its snapshots: %s",
                    exit_text(rc), signal_name(self._stop or 0), said)
        return exit_code(rc)

    def _end_store(self) -> None:
        """The job's end said in the control store (every rank still waiting there ends), and,
        on several nodes, the others' ends waited for (their ranks read it until they exit)."""
        within = max(FOLLOWERS_WAIT_S, self.o.grace_s + 10.0)
        if self._stop is not None:  # their emergency snapshots: STOP would cut them short
            self._wait_followers(within)
        with contextlib.suppress(Exception):
            if self.control is not None and not self.control.check([ip.STOP]):
                self.control.set(ip.STOP, "ciuic run ended")
        self._wait_followers(within)

    def _end_all(self) -> None:
        """Every process still running (spares; ranks after a give-up) is ended."""
        self._end_store()
        end = time.monotonic() + 2.0
        while time.monotonic() < end and self._live():
            time.sleep(0.05)
        for w in self._live():
            with contextlib.suppress(OSError):
                os.kill(w.proc.pid, signal.SIGKILL)
            w.proc.wait()
        for w in self.workers:
            if w.proc.stderr is not None:
                with contextlib.suppress(OSError):
                    w.proc.stderr.close()


def first_failure(workers: list[Worker]) -> int:
    """The first non-zero exit status of ``workers`` (0: none failed, or none has ended)."""
    return next((w.proc.returncode for w in workers if w.proc.returncode), 0)


def _in_child() -> None:
    pdeathsig()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def launch(options: Options, nproc: int, spares: int) -> int:
    if nproc < 1:
        raise ValueError("--nproc-per-node must be at least 1")
    sys.stdout.flush()
    return Launcher(options, nproc, spares).run()
