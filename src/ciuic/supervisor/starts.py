"""What ``ciuic run`` is told to do (:class:`Options`) and what each start of the command did
(:class:`Start`), and the job's snapshots in words at its end (:func:`snapshots_said`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ciuic.supervisor import beat
from ciuic.supervisor.causes import Cause

#: how long a generation's cause not known when it was said is waited for
CAUSE_WAIT_S = 30.0


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
    #: a job of several nodes: how many other nodes hold a replica of this node's chunks, and
    #: how long another node's ciuic run may not answer before this node's workers are
    #: stopped (their collectives would wait far longer) for torchrun to restart them
    replicas: int = 1
    peer_timeout_s: float = 10.0
    poll_s: float = 0.1
    #: set in the command's environment beyond the supervisor's own (cli/run.torchrun_env)
    env: dict[str, str] = field(default_factory=dict)
    #: the command is torchrun: its own ``--max-restarts`` of the workers (None: not known)
    worker_restarts: int | None = None


@dataclass
class Start:
    """What one start of the command did, as the supervisor saw it."""

    number: int
    began: float
    pids: set[int] = field(default_factory=set)
    ranks: dict[int, int] = field(default_factory=dict)  # pid -> rank, of every worker seen
    generation_of: dict[int, int] = field(default_factory=dict)  # pid -> its generation
    step: int | None = None  # the highest step() seen
    committed: int | None = None  # the highest committed step seen
    cause: Cause | None = None
    returncode: int | None = None
    hang_seen_s: float | None = None  # how long after the hang began it was detected
    #: torchrun's restarts of the workers within this start (its ``--max-restarts``): the
    #: current generation, its workers (heartbeat slot -> pid), when one was first seen gone
    #: and whether its cause was said
    generation: int = 1
    workers: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (pid, gen)
    gone_since: float | None = None
    said: bool = False
    cut_off: set[int] = field(default_factory=set)  # nodes this start stopped workers for
    hung_pid: int | None = None  # the worker the last hang detected was
    hang_cause: Cause | None = None  # a hung worker stopped alone (several nodes), not told
    stopping: set[int] = field(default_factory=set)  # workers stopped for a hang
    hang_pending: float | None = None  # when a hang on several nodes was first detected
    #: a generation's end said before its cause was known: (its step, its number, when said);
    #: the cause is said when it arrives (a torchrun line, another node's word), or that it
    #: is still not known after ``CAUSE_WAIT_S``
    unknown: tuple[int | None, int, float] | None = None
    #: that generation's lines for failed workers and lost peers (``Supervisor._failed``)
    unknown_lines: list[str] = field(default_factory=list)
    #: the cause said for the end of a generation, and that generation: a start that ends
    #: before a later generation made a step() ends for it (torchrun's own exit follows)
    told: tuple[str, int] | None = None
    #: then, how torchrun's exit that followed looked (said, not passed on as the cause)
    then: Cause | None = None
    #: each worker's snapshots, from its heartbeat slot: pid -> (committed, failed, the last
    #: failed step)
    snapshots: dict[int, tuple[int, int, int | None]] = field(default_factory=dict)

    def note(self, beats: list[beat.Beat]) -> None:
        """What the workers' heartbeat slots say now (the highest step and commit, each
        worker's snapshots)."""
        for b in beats:
            self.pids.add(b.pid)
            self.ranks[b.pid] = b.rank
            if b.step is not None and (self.step is None or b.step > self.step):
                self.step = b.step
            if b.committed is not None and (self.committed is None
                                            or b.committed > self.committed):
                self.committed = b.committed
            self.snapshots[b.pid] = (b.commits, b.failures, b.failed)


def snapshots_said(starts: Sequence[Start]) -> tuple[str, bool]:
    """The snapshots of every start in words, for ``ciuic run``'s last line, and whether any
    failed. A snapshot is taken by every rank: per generation of workers (torchrun's restarts
    within a start), the most any one worker counted."""
    made = failed = 0
    last_failed: int | None = None
    for start in starts:
        per_generation: dict[int, tuple[int, int]] = {}
        for pid, (commits, failures, step) in start.snapshots.items():
            g = start.generation_of.get(pid, 1)
            c, f = per_generation.get(g, (0, 0))
            per_generation[g] = (max(c, commits), max(f, failures))
            if step is not None and (last_failed is None or step > last_failed):
                last_failed = step
        made += sum(c for c, _ in per_generation.values())
        failed += sum(f for _, f in per_generation.values())
    latest = max((s.committed for s in starts if s.committed is not None), default=None)
    text = (f"{made} committed, the last at step {latest}" if latest is not None and made
            else "none committed")
    if failed:
        text += f"; {failed} failed, the last at step {last_failed} (`ciuic log` lists them)"
    return text, failed > 0
