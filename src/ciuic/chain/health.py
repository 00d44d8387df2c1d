"""Snapshot health: whether a snapshot's state looks damaged, decided when it is committed.

The writer computes every float tensor's statistics while it hashes (:mod:`ciuic.format.stats`);
the commit then judges the snapshot against the recent chain and records the verdict in its
manifest (docs/format.md, "Health"). A snapshot is **unhealthy** when:

* a float tensor holds NaN or Inf;
* the recorded loss (``metrics[loss_metric]``) is NaN or Inf, or spikes: its robust z-score
  over the losses of the last ``loss_window`` snapshots of its lineage (median and MAD) is above
  ``loss_zscore``;
* a watched tensor's L2 norm grew by more than ``norm_jump`` times since the newest healthy
  snapshot of the lineage (the parent, unless it was unhealthy: a divergence that persists
  stays unhealthy; the loss history likewise holds healthy snapshots only).

An unhealthy snapshot is written all the same (it may be the evidence a user needs); ``JOB@healthy``
and ``restore(snapshot="healthy")`` skip it, and retention never prunes the newest healthy one.
Its commit logs a one-line warning, not repeated at every snapshot of a run that stays unhealthy
(:class:`Warnings`). Counters (Adam's ``step`` tensors) are left out of the norms
(:func:`is_counter`).
"""

from __future__ import annotations

import fnmatch
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ciuic.chain.read import body_states
from ciuic.chain.repo import Repository
from ciuic.errors import CiuicError, ConfigurationError
from ciuic.format import stats as st
from ciuic.format.info import SnapshotInfo
from ciuic.format.manifest import HealthVerdict
from ciuic.format.tree import walk_leaves
from ciuic.words import counted, reasons_in_short

log = logging.getLogger("ciuic")
#: the most reasons a manifest lists (the rest are counted)
MAX_REASONS = 8
_MAD_SCALE = 1.4826  # MAD of a normal distribution -> its standard deviation
#: a run unhealthy for the same reasons is reminded of at this many snapshots in a row, then at
#: twice as many each time
REMIND_AFTER = 10


@dataclass(frozen=True)
class HealthPolicy:
    """When a snapshot is marked unhealthy (``SnapshotManager(health=HealthPolicy(...))``).

    Args:
        loss_metric: the metric of ``step(..., loss=...)`` watched for NaN, Inf and spikes.
        loss_zscore: a loss whose robust z-score over the recent chain is above this spikes.
        loss_window: how many recent snapshots of the lineage the z-score is taken over.
        loss_min_history: judge spikes only once this many earlier losses are known.
        norm_jump: a watched tensor whose norm grew by more than this factor since the parent
            snapshot is a jump (None: not checked).
        norm_states: the states whose tensors' norms are watched (the optimizer's moments grow
            fast early in training by design, so the default watches the model only).
        norm_floor: norms below this are too small to judge a jump from (a zero-initialized
            tensor).
        nonfinite_ignore: tensor paths (``fnmatch`` patterns, e.g. ``"model/*.mask"``) whose
            NaN and Inf are meant to be there (an attention mask filled with -inf).
    """

    loss_metric: str = "loss"
    loss_zscore: float = 6.0
    loss_window: int = 20
    loss_min_history: int = 5
    norm_jump: float | None = 10.0
    norm_states: tuple[str, ...] = ("model",)
    norm_floor: float = 1e-6
    nonfinite_ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.loss_zscore, (int, float)) and self.loss_zscore > 0):
            raise ConfigurationError(f"loss_zscore must be a positive number, got "
                                     f"{self.loss_zscore!r}")
        if self.norm_jump is not None and not (isinstance(self.norm_jump, (int, float))
                                               and self.norm_jump > 1):
            raise ConfigurationError(f"norm_jump must be a factor above 1 or None, got "
                                     f"{self.norm_jump!r}")
        for name in ("loss_window", "loss_min_history"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 2:
                raise ConfigurationError(f"{name} must be an integer >= 2, got {v!r}")
        for name in ("norm_states", "nonfinite_ignore"):
            if isinstance(getattr(self, name), str):
                raise ConfigurationError(f"{name} is a tuple of strings, e.g. ('model',)")


def tensor_stats(states: dict[str, Any]) -> dict[str, st.Stats]:
    """Every tensor's statistics in a body's states, by path (tensors without any omitted)."""
    out: dict[str, st.Stats] = {}
    for path, _kind, desc in walk_leaves({k: v for k, v in states.items() if k != "dist"}):
        s = st.of_descriptor(desc)
        if s is not None:
            out[path] = s
    return out


def _state_of(path: str) -> str:
    """The state a tensor path belongs to (``ranks/3/extra/...`` -> ``extra``)."""
    parts = path.split("/")
    return parts[2] if parts[0] == "ranks" and len(parts) > 2 else parts[0]


def robust_z(value: float, history: list[float]) -> float:
    """How far ``value`` lies above the median of ``history``, in robust standard deviations
    (1.4826 x the median absolute deviation; a floor of 1 % of the median keeps a flat
    history, a smoothed loss, from calling a small rise a spike)."""
    med = statistics.median(history)
    mad = statistics.median(abs(h - med) for h in history)
    scale = max(_MAD_SCALE * mad, 1e-2 * abs(med), 1e-12)
    return (value - med) / scale


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def is_counter(path: str, s: st.Stats) -> bool:
    """Whether a tensor counts rather than measures: a one-element tensor named ``step``, the
    per-parameter step of Adam and its kin (a float tensor holding the step number). Integer
    and bool tensors have no statistics at all. A counter is left out of its state's norm (the
    steps would dwarf the moments: the optimizer's norm would be the step x sqrt(parameters))
    and out of the norm-jump check (a count grows by design); NaN or Inf in one is still
    unhealthy."""
    return s.count == 1 and path.rsplit("/", 1)[-1] == "step"


@dataclass(frozen=True)
class Problem:
    """One reason a snapshot is unhealthy: ``key`` names what and where (the same key at the
    next snapshot is the same problem, whatever its numbers), ``text`` says it to a user."""

    key: str
    text: str


def judge(stats: dict[str, st.Stats], metrics: dict[str, Any], losses: list[float],
          parent_norms: dict[str, float] | None, policy: HealthPolicy) -> HealthVerdict:
    """The health record of a snapshot (the manifest's ``health``): ``healthy``, the
    ``reasons`` it is not, the count of NaN/Inf elements and each state's L2 norm (counters
    left out: :func:`is_counter`)."""
    return assess(stats, metrics, losses, parent_norms, policy)[0]


def assess(stats: dict[str, st.Stats], metrics: dict[str, Any], losses: list[float],
           parent_norms: dict[str, float] | None, policy: HealthPolicy
           ) -> tuple[HealthVerdict, list[Problem]]:
    """:func:`judge`'s record, and every problem found (the record lists the first
    ``MAX_REASONS`` of each kind and counts the rest)."""
    bad = [(p, s) for p, s in stats.items() if s.nonfinite
           and not any(fnmatch.fnmatchcase(p, pat) for pat in policy.nonfinite_ignore)]
    nonfinite = []
    for p, s in bad:
        what = " and ".join(f"{n} {name}" for n, name in ((s.nan, "NaN"), (s.inf, "Inf")) if n)
        nonfinite.append(Problem(f"nonfinite {p}", f"{p}: {what} of "
                                 f"{counted(s.count, 'element')}"))
    of_loss = []
    loss = _num(metrics.get(policy.loss_metric))
    if loss is not None:
        if not math.isfinite(loss):
            of_loss.append(Problem("loss nonfinite", f"{policy.loss_metric} is {loss}"))
        elif len(losses) >= policy.loss_min_history:
            z = robust_z(loss, losses)
            if z > policy.loss_zscore:
                of_loss.append(Problem("loss spike", (
                    f"{policy.loss_metric} {loss:.6g} spikes: robust z-score {z:.1f} over the "
                    f"last {len(losses)} snapshots (median {statistics.median(losses):.6g}; "
                    f"threshold {policy.loss_zscore:g})")))
    jumps = []
    if policy.norm_jump is not None and parent_norms:
        found = []
        for p, s in stats.items():
            before = parent_norms.get(p)
            if (before is None or before < policy.norm_floor or s.nonfinite
                    or _state_of(p) not in policy.norm_states or is_counter(p, s)):
                continue
            if s.norm > policy.norm_jump * before:
                found.append((s.norm / before, p, before, s.norm))
        found.sort(reverse=True)
        jumps = [Problem(f"norm {p}", f"{p}: norm jumped {factor:.1f}x since the last healthy "
                         f"snapshot ({before:.4g} -> {after:.4g}; threshold "
                         f"{policy.norm_jump:g}x)") for factor, p, before, after in found]
    reasons = (_capped(nonfinite, "more tensor holds NaN or Inf",
                       "more tensors hold NaN or Inf")
               + [q.text for q in of_loss]
               + _capped(jumps, "more tensor's norm jumped", "more tensors' norms jumped"))
    sumsq: dict[str, float] = {}
    for p, s in stats.items():
        if not is_counter(p, s):
            sumsq[_state_of(p)] = sumsq.get(_state_of(p), 0.0) + s.sumsq
    for p, s in bad:  # its finite elements' norm would look healthy: the state's is NaN or Inf
        sumsq[_state_of(p)] = sumsq.get(_state_of(p), 0.0) + (math.nan if s.nan else math.inf)
    record = HealthVerdict(
        healthy=not reasons, reasons=tuple(reasons),
        nonfinite=sum(s.nonfinite for s in stats.values()),
        norms={k: float.__repr__(math.sqrt(v)) for k, v in sorted(sumsq.items())})
    return record, nonfinite + of_loss + jumps


def _capped(problems: list[Problem], one_more: str, more: str) -> list[str]:
    """The texts of the first ``MAX_REASONS`` problems, and a line that counts the rest."""
    rest = len(problems) - MAX_REASONS
    return [q.text for q in problems[:MAX_REASONS]] + (
        [f"and {counted(rest, one_more, more)}"] if rest > 0 else [])


@dataclass
class Warnings:
    """The warnings of one run's unhealthy snapshots, one short line each, never one per
    snapshot of a run that stays unhealthy: a run that diverged writes an unhealthy snapshot
    at every interval until someone stops it, and a log of identical warnings hides the one
    line that matters, the first.

    * The first unhealthy snapshot: its step, its first reason (two if they are short), how
      many more, and ``ciuic inspect PROJECT/JOB@STEP``, which lists them all.
    * A later one with a reason not warned of yet in this streak (another tensor turned NaN,
      the loss spiked too): the same line, with the new reasons first.
    * A streak that goes on for the same reasons: a reminder at its 10th snapshot, then at its
      20th, 40th, 80th ... (how long, since which step).
    * The first healthy snapshot after a streak: that it is healthy again, after how many.
    """

    streak: int = 0  # unhealthy snapshots in a row
    since: int = 0  # the step of the streak's first
    last_step: int = 0
    named: set[str] = field(default_factory=set)  # the problems warned of in this streak
    remind_at: int = REMIND_AFTER

    def snapshot(self, where: str, step: int, problems: list[Problem]) -> None:
        """A snapshot of job ``where`` (``PROJECT/JOB``) was committed at ``step`` with these
        problems (none: healthy)."""
        if not problems:
            if self.streak:
                log.warning("snapshot at step %d of %s is healthy again, after %s (steps %d to "
                            "%d)", step, where, counted(self.streak, "unhealthy snapshot"),
                            self.since, self.last_step)
            self.streak, self.named, self.remind_at = 0, set(), REMIND_AFTER
            return
        self.streak, self.last_step = self.streak + 1, step
        ref = f"{where}@{step}"
        new = [q for q in problems if q.key not in self.named]
        if self.streak == 1:
            self.since = step
            log.warning("snapshot at step %d of %s is unhealthy: %s", step, where,
                        reasons_in_short([q.text for q in problems], ref))
        elif new:
            log.warning("snapshot at step %d of %s is unhealthy for %s: %s", step, where,
                        "a new reason" if len(new) == 1 else "new reasons",
                        reasons_in_short([q.text for q in new] + [
                            q.text for q in problems if q not in new], ref))
        elif self.streak >= self.remind_at:
            log.warning("%s is still unhealthy at step %d, %s in a row since step %d: %s",
                        where, step, counted(self.streak, "snapshot"), self.since,
                        reasons_in_short([q.text for q in problems], ref))
        if self.streak >= self.remind_at:
            self.remind_at *= 2
        self.named.update(q.key for q in problems)


@dataclass
class HealthTracker:
    """What judging the next snapshot needs from the chain, kept between commits: the losses of
    the recent snapshots of the lineage and the parent's tensor norms. Rebuilt from the catalog
    and the parent's body when the next snapshot's parent is not the last one judged (a resume,
    another process's commit). Its :class:`Warnings` say which snapshots are unhealthy."""

    policy: HealthPolicy = field(default_factory=HealthPolicy)
    last_id: str = ""
    losses: deque[float] = field(default_factory=deque)
    norms: dict[str, float] | None = None
    warnings: Warnings = field(default_factory=Warnings)
    _judged: dict[str, float] = field(default_factory=dict)
    _problems: list[Problem] = field(default_factory=list)

    def judge(self, repo: Repository, project: str, job: str, parent: str,
              states: dict[str, Any], metrics: dict[str, Any],
              more: dict[str, st.Stats] | None = None) -> HealthVerdict:
        """The verdict on a snapshot of ``states`` (their descriptors' statistics, and
        ``more``: those of tensors the states do not hold, by path)."""
        if parent != self.last_id or not parent:
            self._rebuild(repo, project, job, parent)
        stats = tensor_stats(states) | (more or {})
        self._judged = {p: s.norm for p, s in stats.items()}  # the baseline, if committed
        record, self._problems = assess(stats, metrics, list(self.losses), self.norms,
                                        self.policy)
        return record

    def committed(self, sid: str, metrics: dict[str, Any], healthy: bool) -> None:
        """The snapshot just judged was committed as ``sid`` (with these metrics): the next
        one's parent. Only a healthy one becomes the baseline: after a divergence, the
        snapshots that follow are judged against the last healthy state, not the diverged
        one."""
        self.last_id = sid
        if healthy:
            self.norms = self._judged
            self._add_loss(metrics)

    def warn(self, project: str, job: str, step: int) -> None:
        """Warn of the snapshot just committed at ``step`` if it is unhealthy (or healthy
        again), as :class:`Warnings` says."""
        self.warnings.snapshot(f"{project}/{job}", step, self._problems)

    def _add_loss(self, metrics: dict[str, Any]) -> None:
        loss = _num(metrics.get(self.policy.loss_metric))
        if loss is not None and math.isfinite(loss):
            self.losses.append(loss)
            while len(self.losses) > self.policy.loss_window:
                self.losses.popleft()

    def _rebuild(self, repo: Repository, project: str, job: str, parent: str) -> None:
        self.losses.clear()
        self.norms = None
        self.last_id = parent
        if not parent:
            return
        try:
            every = {s.id: s for s in repo.catalog.snapshots(project, job, status=None)}
            chain: list[SnapshotInfo] = []  # the lineage's snapshots not judged unhealthy
            sid, seen = parent, 0
            while sid in every and len(chain) < self.policy.loss_window and seen < 10_000:
                if every[sid].healthy is not False:
                    chain.append(every[sid])
                sid, seen = every[sid].parent, seen + 1
            for info in reversed(chain):
                self._add_loss(info.metrics)
            base = next((s for s in chain if s.status == "committed"), None)
            if base is not None:  # the newest healthy ancestor whose body is still stored
                m = repo.read_manifest(project, job, base.id)
                self.norms = {p: s.norm for p, s in tensor_stats(body_states(repo, m)).items()}
        except (CiuicError, OSError) as e:  # health is advisory: never fail a commit over it
            log.warning("snapshot health: could not read the chain before %s (%s); the "
                        "norm-jump check skips this snapshot", parent[:12], e)
