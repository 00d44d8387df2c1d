"""A node other than the leader in ``ciuic run --nproc-per-node N --nnodes M`` (docs/recovery.md,
"Several nodes"): it starts, watches and replaces its own ranks; the leader (node 0) decides.

- It joins the job through the leader's control store (``--master-addr:--master-port``,
  waited for while node 0 starts) and its node link (:mod:`ciuic.supervisor.fleet`), and
  starts its warm spares at once. Its ranks start when the leader gives the node its place
  (``nodes/place/<node rank>``): at the job's start its own (node rank K: ranks ``K * N ..``),
  for a spare node a lost node's, in the generation then open.
- What it sees of its ranks goes to the leader through the control store: a rank that died
  (``died/``, with how), ranks silent past ``--hang-timeout`` (``hung/``). A rank that raises
  reports it itself.
- When the leader opens the next generation, it replaces its ranks whose process ended (a
  warm spare, or a new process); after a hang it kills and replaces those of its ranks that
  did not leave the hung generation within ``STUCK_S``.
- When the leader is lost (its node link closes or falls silent, or its control store stops
  answering) it ends its ranks and exits 1: in-process recovery cannot go on without the
  control store, and the job's next start (by the scheduler) restores from the snapshots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from datetime import timedelta
from typing import Any

from ciuic.errors import ConfigurationError
from ciuic.supervisor import beat
from ciuic.supervisor import inprocess as ip
from ciuic.supervisor.causes import OomWatch, classify
from ciuic.supervisor.fleet import LINK, PLACE, FollowerLink, NodeSpec
from ciuic.supervisor.launch import POLL_S, STUCK_S, Launcher, Worker, first_failure
from ciuic.supervisor.procs import exit_code, exit_text
from ciuic.supervisor.starts import Options, Start, snapshots_said
from ciuic.words import counted

log = logging.getLogger("ciuic.run")
#: how long a node waits for the leader's control store at its start
JOIN_TIMEOUT_S = 600.0


class Follower(Launcher):
    """A node's ``ciuic run`` that follows node 0's."""

    def __init__(self, options: Options, nproc: int, spares: int, spec: NodeSpec) -> None:
        super().__init__(options, nproc, spares, spec)
        self.slot = None  # the leader gives the node its place
        self.up: FollowerLink | None = None
        self._hang_said = -1  # the last generation whose hang this node reported
        self._ending = False  # the leader said the job's end (finished, or stopped)

    def _control_store(self) -> Any:
        from torch._C._distributed_c10d import TCPStore

        assert self.spec is not None
        log.info("ciuic run: node %d joins the job at %s:%d", self.spec.node_rank,
                 self.spec.master_addr, self.spec.master_port)
        try:
            return TCPStore(self.spec.master_addr, self.spec.master_port, is_master=False,
                            timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        except RuntimeError as e:  # (torch's DistNetworkError, DistStoreError)
            raise ConfigurationError(
                f"node {self.spec.node_rank} could not reach node 0's control store at "
                f"{self.spec.master_addr}:{self.spec.master_port} within {JOIN_TIMEOUT_S:g} s "
                f"({str(e).splitlines()[0]}): is node 0's ciuic run started, and are "
                "--master-addr and --master-port node 0's?") from None

    def _begin(self) -> None:
        assert self.spec is not None
        port = int(self.control.get(LINK).decode())
        self.up = FollowerLink(self.spec.master_addr, port, self.spec.node_rank,
                               self.o.peer_timeout_s)
        if self.up.again:
            self.spare_prefix = f"{self.spec.node_rank}r{self.up.again}"
        # a store request on a silent leader fails past --peer-timeout, not 10 minutes
        self.control.set_timeout(timedelta(seconds=self.o.peer_timeout_s))
        self.gen = int(self.control.get(ip.GEN).decode())
        self.starts.append(Start(self.gen, time.monotonic()))

    def _end_store(self) -> None:
        """Nothing: the job's end is the leader's to say (this node's ranks have ended)."""
        if self.up is not None:
            self.up.close()

    def _loop(self) -> int:
        assert self.holder is not None and self.spec is not None
        oom = OomWatch()
        while True:
            try:
                gone = self.up.gone if self.up is not None else None
                if gone is None:
                    return_code = self._poll(oom)
                    if return_code is not None:
                        return return_code
            except (OSError, RuntimeError, ValueError) as e:  # the control store is gone
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                gone = f"the leader's control store does not answer ({first})"
            if gone is not None:
                if self._ending or self._stop is not None:
                    return self._own_end()  # the leader ended first: its job is over
                return self._leader_lost(gone)
            self._wake.wait(POLL_S)

    def _own_end(self) -> int:
        """The job ended (finished, stopped) and the leader with it: this node's ranks end
        by themselves (a final or emergency snapshot); their exit code, once they have."""
        end = time.monotonic() + self.o.grace_s + 5.0
        mine = self._mine()
        while time.monotonic() < end and any(w.proc.poll() is None for w in mine):
            time.sleep(0.05)
        return exit_code(first_failure(mine))

    def _poll(self, oom: OomWatch) -> int | None:
        """One look at this node's ranks and the job; the exit code once this node is done."""
        assert self.holder is not None and self.spec is not None
        start = self.starts[-1]
        beats = beat.read(self.holder.beats)
        start.note([b for b in beats if b.busy != beat.BUSY[7] or b.commits])
        ranks = [w for w in self.workers if w.rank is not None and not w.done]
        for w in ranks:
            rc = w.proc.poll()
            if rc == 0:
                w.done = True
            elif rc is not None:
                w.done = True
                self._report_death(w, rc, oom)
        self._spares_alive()
        mine = self._mine()
        ended = all(x.proc.poll() is not None for x in mine)
        if self._stop is not None:
            if ended:
                return self._stopped()
            return None
        finished, stopped = self.control.check([ip.FINISHED]), self.control.check([ip.STOP])
        self._ending = finished or stopped
        if self.slot is not None and mine and ended and finished and all(
                w.proc.returncode == 0 for w in mine):
            log.info("ciuic run: node %d: its ranks finished (exit 0)", self.spec.node_rank)
            return 0
        if mine and ended and stopped:
            return self._told_to_stop(mine)
        if self.slot is None and stopped:
            log.info("ciuic run: spare node %d: the job ended (%s) without needing it",
                     self.spec.node_rank, self.control.get(ip.STOP).decode())
            return 0
        if self.slot is None and self.control.check([PLACE + str(self.spec.node_rank)]):
            self._take_place()
        latest = int(self.control.get(ip.GEN).decode())
        if latest > self.gen:
            holder = self._slot_holder()
            if holder is not None and holder != str(self.spec.node_rank):
                return self._left_out(holder)
            self._follow(latest)
        if self._stuck is not None and time.monotonic() >= self._stuck[1]:
            self._kill_stuck([w for w in self.workers if w.rank is not None and not w.done])
        if self._stuck is None and self._hang_said < self.gen:
            hung = self._hung(beats, ranks)
            if hung is not None:
                self._hang_said = self.gen
                self.control.set(ip.HUNG + str(self.gen),
                                 f"{hung.text} on node {self.spec.node_rank}")
        return None

    def _report_death(self, w: Worker, rc: int, oom: OomWatch) -> None:
        """A rank of this node died: the leader hears how (its first such report in a
        generation names the generation's cause)."""
        c = classify(rc, list(w.tail), oom)
        g = str(self.gen)
        order = self.control.add(ip.DEATHS + g, 1)
        self.control.set(f"{ip.DIED}{g}/{w.rank}",
                         f"{order} {c.kind} rank {w.rank} (pid {w.proc.pid}, node "
                         f"{self.slot}): {c.text}")

    def _take_place(self) -> None:
        """The leader gave this node a place: start its ranks in that generation."""
        assert self.spec is not None
        slot, gen = (int(x) for x in self.control.get(
            PLACE + str(self.spec.node_rank)).decode().split())
        if self.control.get(ip.SLOT + str(slot)).decode() != str(self.spec.node_rank):
            return  # (a place an earlier start of this node had, given to another since)
        self.slot = slot
        self._env["GROUP_RANK"] = self._env["ROLE_RANK"] = str(slot)
        if gen > self.gen:
            self.gen = gen
            self.starts.append(Start(gen, time.monotonic()))
        how = self._replace(list(self._local_ranks()))
        if slot != self.spec.node_rank or gen:
            log.warning("ciuic run: node %d takes node %d's place in generation %d: %s",
                        self.spec.node_rank, slot, gen, ", ".join(how))

    def _follow(self, gen: int) -> None:
        """The leader opened generation ``gen``: this node's ranks whose process ended are
        replaced; after a hang, those that do not leave the hung generation are stuck."""
        causes = {g: self.control.get(ip.CAUSE + str(g)).decode()
                  for g in range(self.gen + 1, gen + 1) if self.control.check([ip.CAUSE + str(g)])}
        hung = [g for g, c in causes.items() if c.startswith("hang")]  # (one opened since?)
        cause = causes.get(gen, "")
        self.gen = gen
        self.starts.append(Start(gen, time.monotonic()))
        if self.control.check([ip.FULL + str(gen)]):  # a full restart: every rank anew
            self._end_local_ranks()
        ended = [w for w in self._mine() if w.proc.poll() is not None]
        for w in ended:
            w.done = True
        lost = [w.rank for w in ended if w.rank is not None]
        how = self._replace(lost)
        if hung and self.slot is not None and self._stuck is None:
            self._stuck = (hung[0] - 1, time.monotonic() + STUCK_S)
        if self.slot is not None:
            stay = self.nproc - len(lost)
            log.info("ciuic run: node %d: generation %d (%s): %s %s%s",
                     self.slot, gen, cause or "no cause said", counted(stay, "rank"),
                     "stays in its process" if stay == 1 else "stay in their processes",
                     f"; {', '.join(how)}" if how else "")

    def _slot_holder(self) -> str | None:
        """The node rank of the node that holds this node's slot now, as the leader says."""
        if self.slot is None or not self.control.check([ip.SLOT + str(self.slot)]):
            return None
        return str(self.control.get(ip.SLOT + str(self.slot)).decode())

    def _left_out(self, holder: str) -> int:
        """The leader gave this node's ranks to another node (it was cut off past
        ``--peer-timeout``): its own ranks end, and so does it."""
        assert self.spec is not None
        log.error("ciuic run: node %d was lost to the job (cut off for longer than "
                  "--peer-timeout?) and %s its ranks now: ending this node's ranks",
                  self.spec.node_rank, "another node takes" if holder == ip.NO_NODE
                  else f"node {holder} holds")
        return self._kill_live()

    def _told_to_stop(self, mine: list[Worker]) -> int:
        """The leader stopped the job (it gave up, or was stopped) and this node's ranks have
        ended."""
        why = self.control.get(ip.STOP).decode()
        rc = first_failure(mine)
        said, _ = snapshots_said(self.starts)
        log.warning("ciuic run: node %d: the job stopped (%s); its ranks exited (%s). Its "
                    "snapshots: %s", self.slot, why, exit_text(rc), said)
        return exit_code(rc)

    def _leader_lost(self, why: str) -> int:
        """Without the leader there is no control store: this node's ranks are ended."""
        assert self.spec is not None
        with contextlib.suppress(Exception):  # the store may answer again (a link cut, back)
            holder = self._slot_holder()
            if holder is not None and holder != str(self.spec.node_rank):
                return self._left_out(holder)
        log.error("ciuic run: node %d: %s. In-process recovery cannot go on without node 0 "
                  "(it holds the job's control store): ending this node's ranks. Start the "
                  "job again (on every node) and it resumes from its last snapshot.",
                  self.spec.node_rank, why)
        return self._kill_live()

    def _kill_live(self) -> int:
        """Out of the job: every process of this node SIGKILLed (no emergency snapshot: it
        could not commit without the job's other ranks); exit 1."""
        for w in self._live():
            with contextlib.suppress(OSError):
                os.kill(w.proc.pid, signal.SIGKILL)
        return 1


def launch_nodes(options: Options, nproc: int, spares: int, spec: NodeSpec) -> int:
    """``ciuic run --nproc-per-node N --nnodes M``: node 0 leads, the others follow."""
    if spec.leads:
        return Launcher(options, nproc, spares, spec).run()
    return Follower(options, nproc, spares, spec).run()
