"""``SnapshotManager``: the one object a training loop talks to.

    from ciuic.snapshot import SnapshotManager
    manager = SnapshotManager(project_id="deepseek_v2", save_interval=1000)
    last = manager.restore(model, optimizer)  # None for a new job; 0 is a step
    start = 0 if last is None else last + 1
    for step in range(start, total_steps):
        ...  # forward, backward, optimizer.step()
        manager.step(step, model, optimizer)

A step number is the step whose optimizer update has just been applied; a snapshot taken at step
N holds the state after N's update, and a resumed run continues at N + 1.

The manager is a facade over parts that never import it: the configuration
(:mod:`~ciuic.manager.config`), the run session (:mod:`~ciuic.manager.session`), the save policy
(:mod:`~ciuic.manager.policy`), the pipeline (:mod:`~ciuic.manager.pipeline`, local or
:mod:`~ciuic.manager.ranked`, chosen here once), recovery (:mod:`~ciuic.manager.recovery`) and
signals (:mod:`~ciuic.manager.signals`).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import Any

from ciuic.chain import runs
from ciuic.chain.health import HealthPolicy
from ciuic.chain.lease import Lease
from ciuic.distributed.collective import Collective
from ciuic.errors import CaptureError, CiuicError, ConfigurationError
from ciuic.format.crypto import ObjectCodec
from ciuic.format.info import SnapshotInfo
from ciuic.format.records import RunRow
from ciuic.manager.config import ManagerOptions, check_state_args, check_step, options_doc
from ciuic.manager.interval import AutoInterval, IntervalTuner
from ciuic.manager.pipeline import LocalPipeline, Pipeline
from ciuic.manager.policy import SavePolicy
from ciuic.manager.ranked import RankedPipeline
from ciuic.manager.recovery import Recovery
from ciuic.manager.session import (
    RunSession,
    ensure_log_handler,
    quiet_other_ranks,
)
from ciuic.manager.signals import SignalGuard
from ciuic.manager.stats import ManagerStats
from ciuic.manager.supervised import busy, join_peers, multi_node
from ciuic.state.ddp import pin_buckets
from ciuic.store import Store
from ciuic.supervisor import inprocess

log = logging.getLogger("ciuic")


class SnapshotManager:
    """Snapshots a training job as it runs and restores it after an interruption.

    The arguments are the options of :class:`~ciuic.manager.config.ManagerOptions`, each
    documented once there; the list below is built from that documentation.
    """

    def __init__(self, project_id: str, api_key: str | None = None,
                 save_interval: int | str | AutoInterval | None = 1000,
                 encryption: bool = False, *,
                 job: str | None = None,
                 store: str | os.PathLike[str] | Store | None = None,
                 time_interval_s: float | str | None = None,
                 keep_last: int | None = None, keep_every: int | None = None,
                 handle_signals: bool = True, asynchronous: bool = True,
                 on_busy: str = "wait", staging_budget_bytes: int | None = None,
                 mirror: str | Store | None = None, durability: str | None = None,
                 compression: str = "auto", overlap: bool = False,
                 endpoint: str | None = None, distributed: bool | None = None,
                 health: bool | HealthPolicy = True) -> None:
        """The signature is ``ManagerOptions``' own, spelled out so that ``help()``, IDEs and
        mypy show every argument with its type and default: ``**options: Unpack[TypedDict]``
        would hide the defaults and could not keep the first four positional, and a generated
        ``__init__`` (``dataclass_transform``) would make every option an attribute of the
        manager. ``tests/test_manager.py`` fails when the two differ in a name, order, kind,
        default or type."""
        given = dict(locals())  # exactly the options: the signature is ManagerOptions'
        del given["self"]
        self.config = c = ManagerOptions(**given).check()
        self.project, self.job = c.project, c.job
        ensure_log_handler()
        # ciuic's own gloo groups under torchrun (every rank builds its manager); trivial in a
        # single process or with distributed=False
        self.coll = Collective(None if c.distributed is None else bool(c.distributed))
        if self.coll.enabled:
            quiet_other_ranks(self.coll.rank)
        self._session = RunSession(c, self.coll)
        self.repo = self._session.repo
        # a key that is not configured is refused here, before the run is recorded
        codec = ObjectCodec(self.repo.keyring if c.encryption else None)
        self._session.start()
        self.stats = ManagerStats()
        self._policy = SavePolicy(c, self.coll, self.stats)
        if c.auto_interval is not None:
            failures, seen = (runs.failure_history(
                self.repo.catalog.runs(self.project, self.job), self.run_id)
                if self.coll.coordinator else (0, 0.0))
            self._policy.auto(IntervalTuner(c.auto_interval, failures, seen))
        self._pipeline: Pipeline[Any] = (RankedPipeline if self.coll.enabled else LocalPipeline)(
            c, self._session, self.coll, self.stats, codec)
        self._recovery = Recovery(self._session, self.coll, self._pipeline)
        if self.coll.enabled and multi_node():  # the other nodes' memory, and replicas
            join_peers(self._session.supervised, self.coll, codec.name_key)
        self.restored: SnapshotInfo | None = None
        self.restored_values: dict[str, Any] = {}
        self._restore_called = False
        self._first_step_checked = False
        #: the last step() given state, for the final snapshot at a clean close()
        self._last_state: tuple[int, Any, Any, dict[str, Any]] | None = None
        self._closed = False
        self._signals = SignalGuard(self._session.record_end)
        if c.handle_signals:
            self._signals.install()
        if self._session.supervised is not None:  # built: silence from here on is a hang
            self._session.supervised.beacon.started()
        inprocess.opened(self)  # under ciuic.recoverable: a fault abandons it if still open

    # -- what the run is ---------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self._session.run_id

    @property
    def interrupted(self) -> bool:
        """Whether the previous run of this job ended other than cleanly."""
        return self._session.interrupted

    @property
    def previous_run(self) -> RunRow | None:
        """The catalog's record of the job's previous run (how it ended), if any."""
        return self._session.previous_run

    @property
    def signal_pending(self) -> bool:
        """Whether a handled signal (SIGTERM, SIGINT) arrived: the next :meth:`step` that is
        given the state takes the emergency snapshot and exits. Integrations that pass the
        state only on due steps pass it when this is True."""
        return self._signals.pending is not None

    @property
    def lease(self) -> Lease | None:
        """This run's lease on the job (rank 0; None on the other ranks)."""
        return self._session.lease

    # -- the training loop's calls -----------------------------------------------------------

    def step(self, step: int, model: Any = None, optimizer: Any = None, *,
             snapshot: bool | None = None, **extras: Any) -> bool:
        """Call after the optimizer update of ``step``; snapshots when due.

        ``snapshot`` overrides the triggers for this step: True snapshots it (unless it is the
        latest already), False does not; the default lets ``save_interval`` and
        ``time_interval_s`` decide. Integrations pass the framework's own decision (a
        ``Trainer``'s ``save_steps``). Signals are handled either way.

        Returns whether a snapshot was taken: started (its state staged, the write running in
        the background) when ``asynchronous``, committed otherwise. A snapshot failed by the
        storage never stops training: it is logged, counted in ``stats``, and the previous
        snapshot stays the latest. State that cannot be captured (it would fail every
        snapshot) raises :class:`~ciuic.errors.CaptureError`.
        """
        return self._policy.timed(lambda: self._step(step, model, optimizer, snapshot, extras),
                                  self._pipeline.busy, background=self.config.asynchronous)

    def _step(self, step: int, model: Any, optimizer: Any, snapshot: bool | None,
              extras: dict[str, Any]) -> bool:
        if snapshot is not None and not isinstance(snapshot, bool):
            raise TypeError(f"step(snapshot=...) takes True, False or None, got {snapshot!r}")
        self._check_open()
        step = check_step(step)
        check_state_args("step", model, optimizer)
        if self._pipeline.fatal is not None and not self.coll.enabled:
            self._pipeline.raise_fatal()  # a snapshot the writer found would fail every time
        if model is not None or optimizer is not None or extras:
            self._last_state = (step, model, optimizer, extras)
        if not self._first_step_checked:
            self._first_step_checked = True
            if not self._restore_called:
                self._session.warn_if_not_resuming(step)
        now = time.monotonic()
        if self.coll.enabled:
            try:
                due, sig, fatal = self._policy.agree(step)
                if fatal:  # on every rank at this step, not at whichever step each learnt it
                    self._pipeline.raise_fatal()
                if snapshot is not None:  # the framework's decision, the same on every rank
                    due = snapshot and step != self._policy.last_save_step
                self._session.heartbeat(step, now)  # first: where a stop here stopped
                if sig:  # a signal on any rank stops every rank here
                    self._signals.pending = self._signals.pending or sig
                    self._emergency(step, model, optimizer, extras)
                return due and self._take(step, model, optimizer, extras)
            finally:
                if not self._closed:
                    self._policy.post_agreement(step, self._signals.pending,
                                                self._pipeline.fatal is not None)
        self._session.heartbeat(step, now)  # first: where a stop here stopped
        if self._signals.pending is not None:
            self._emergency(step, model, optimizer, extras)
        due = (self._policy.due(step, self._policy.time_due(now)) if snapshot is None
               else snapshot and step != self._policy.last_save_step)
        if not due:
            if not self._pipeline.reserved:
                self._pipeline.reserve(model, optimizer, extras)
            return False
        return self._take(step, model, optimizer, extras)

    def _take(self, step: int, model: Any, optimizer: Any, extras: dict[str, Any]) -> bool:
        """A snapshot is due: take it (the rest of :meth:`step`); not a hang for ``ciuic
        run``, however long it waits or writes."""
        with busy(self._session.supervised, "save"):
            return self._take_now(step, model, optimizer, extras)

    def _take_now(self, step: int, model: Any, optimizer: Any, extras: dict[str, Any]) -> bool:
        if model is None and optimizer is None and not extras:
            log.warning("step(%d): a snapshot is due but step() was given no state to save "
                        "(pass the model and optimizer)", step)
            return False
        if self._pipeline.busy() and not self._policy.proceed_while_busy(step, self.wait):
            return False
        try:  # never let a snapshot failure stop training
            future = self._submit(step, model, optimizer, extras,
                                  inline=not self.config.asynchronous)
        except (CaptureError, ConfigurationError):
            raise  # the caller's mistake (state that cannot be stored): it fails every time
        except Exception as e:
            self._pipeline.failed(step, e)
            return False
        if not self.config.asynchronous:
            try:
                future.result()
            except Exception:
                return False  # already logged and counted by the writer
        return True

    def save(self, step: int, model: Any = None, optimizer: Any = None,
             **extras: Any) -> SnapshotInfo:
        """Snapshot now, wait until it is committed, and return its info. Raises on failure
        (unlike :meth:`step`)."""
        self._check_open()
        with busy(self._session.supervised, "save"):
            self.wait()
            # written on this thread, at its priority: the caller waits for it
            return self._submit(step, model, optimizer, extras, inline=True).result()

    def save_async(self, step: int, model: Any = None, optimizer: Any = None,
                   **extras: Any) -> Future[SnapshotInfo]:
        """Snapshot now; return once the state is staged, with a future of the committed info.

        The values are those of the moment of the call, although training may change the live
        tensors right after. Waits first if a previous snapshot is still in flight.
        """
        self._check_open()
        with busy(self._session.supervised, "wait"):
            # not for a rollback's check of the store: the write queues behind it, unstalled
            self._pipeline.wait(checks=False)
        return self._submit(step, model, optimizer, extras)

    def _submit(self, step: int, model: Any, optimizer: Any, extras: dict[str, Any],
                inline: bool = False) -> Future[SnapshotInfo]:
        n = check_step(step)
        check_state_args("save", model, optimizer)
        return self._pipeline.submit(n, model, optimizer, extras,
                                     lambda: self._policy.taken(n), inline=inline)

    def wait(self) -> None:
        """Block until every started snapshot is durable and committed (or has failed: failures
        are logged and counted in ``stats``, not raised here), and until staging buffers being
        allocated ahead of the first snapshot are ready."""
        with busy(self._session.supervised, "wait"):
            self._pipeline.wait()

    def latest(self) -> SnapshotInfo | None:
        """The newest committed snapshot of this job, or None."""
        self.repo.sync_job(self.project, self.job)
        return self.repo.catalog.latest(self.project, self.job)

    # -- restore -----------------------------------------------------------------------------

    def restore(self, model: Any = None, optimizer: Any = None, *, snapshot: str | None = None,
                **extras: Any) -> int | None:
        """Load the latest complete snapshot (or ``snapshot``) into the given objects.

        Returns the step it recorded (training continues at that step + 1), or None when the job
        has no snapshot. A damaged latest snapshot is skipped for the previous one, with a
        warning; if snapshots exist but none loads, raises :class:`RestoreError`.

        ``snapshot``: an ID, an ID prefix, ``"JOB@STEP"``, or ``"healthy"``: the newest snapshot
        of this job judged healthy (no NaN or Inf, no loss spike, no norm jump; a damaged one
        falls back to the previous healthy one). The chain continues from the snapshot loaded.
        """
        self._check_open()
        check_state_args("restore", model, optimizer)
        with busy(self._session.supervised, "restore"):
            return self._restore(model, optimizer, extras, snapshot)

    def _restore(self, model: Any, optimizer: Any, extras: dict[str, Any],
                 snapshot: str | None) -> int | None:
        self.wait()
        self._restore_called = True
        pin_buckets(model)  # every run of a DDP job reduces in one layout (state/ddp.py)
        done = self._recovery.restore(model, optimizer, extras, snapshot)
        self._pipeline.reserve_after_restore(model, optimizer, restored=done is not None)
        if done is None:
            return None
        info = done.info
        self.restored, self.restored_values = info, done.values
        self._policy.taken(info.step)
        self._session.event("restore", info.step, info.id)
        log.info("%s", resuming(info, self.coll.world_size if self.coll.enabled else 1))
        return info.step

    # -- start-up checks, signals, lifecycle -------------------------------------------------

    def _emergency(self, step: int, model: Any, optimizer: Any, extras: dict[str, Any]) -> None:
        """A signal was received: snapshot this step (unless it is the latest) and exit."""
        with busy(self._session.supervised, "emergency"):
            name, code = self._signals.name, 128 + (self._signals.pending or 0)
            self.wait()
            if model is not None or optimizer is not None:
                self._save_last(step, model, optimizer, extras, emergency=True)
            self._session.record_end(f"signal:{name}")  # at this step(): heartbeat() recorded it
            self.close(final=False)
            raise SystemExit(code)

    def _save_last(self, step: int, model: Any, optimizer: Any, extras: dict[str, Any],
                   emergency: bool = False) -> None:
        """The emergency or the final snapshot: of ``step`` unless the latest holds it already;
        a failure is logged, not raised. After :meth:`wait`."""
        if step == self._pipeline.last_committed_step:
            return
        try:
            info = self.save(step, model, optimizer, **extras)
        except (CiuicError, OSError) as e:  # counted and logged by the pipeline already
            _said_last(step, emergency, error=e, latest=self._pipeline.last_committed_step)
            return
        _said_last(step, emergency, saved=info.short_id)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this SnapshotManager is closed; create a new one")

    def close(self, final: bool = True) -> None:
        """Finish: snapshot the last step given to :meth:`step` if no snapshot holds it yet
        (``final``; so that ``JOB@latest`` is the finished state, and a finished job run again
        trains nothing twice), record a clean end of the run and release resources.
        Idempotent. Leaving a ``with`` block by an exception closes without that snapshot."""
        if self._closed:
            return
        with busy(self._session.supervised, "close"):
            self._close(final)

    def _close(self, final: bool, abandoned: bool = False) -> None:
        """``abandoned``: left after a fault that :func:`ciuic.recoverable` recovers from in
        this process. The ranks no longer agree (their groups are aborted): no collective, no
        snapshot, no wait for the one in flight beyond a few seconds; the staging buffers stay
        in ``ciuic run``'s host memory for the next generation's restore."""
        if final:
            self._final_snapshot()
        self._closed = True
        if abandoned:
            self._pipeline.abandon()
            self._policy.abandon()
        else:
            self._pipeline.close()
            self._policy.close()
            self._session.record_end("clean")
        self._signals.close()
        self.coll.close()
        self._session.close(abandoned=abandoned)

    def __enter__(self) -> SnapshotManager:
        return self

    def __exit__(self, tp: type[BaseException] | None, value: BaseException | None,
                 tb: Any) -> None:
        self._session.record_exit(tp, value)
        if value is not None and not self._closed and inprocess.on_fault(value):
            self._close(final=False, abandoned=True)
        else:
            self.close(final=tp is None)

    def finish(self) -> SnapshotInfo | None:
        """Snapshot the last step given to :meth:`step` unless a snapshot holds it already, and
        wait until every snapshot is committed; return the latest snapshot. For the end of
        training when the manager stays open (an integration's ``train()``); :meth:`close`
        does the same."""
        self._check_open()
        self._final_snapshot()
        self.wait()
        return self.latest()

    def _final_snapshot(self) -> None:
        if self._last_state is not None:
            step, model, optimizer, extras = self._last_state
            self._last_state = None  # the objects are the caller's: not kept past the close
            self.wait()
            self._save_last(step, model, optimizer, extras)


def _said_last(step: int, emergency: bool, *, saved: str = "", error: BaseException | None = None,
               latest: int | None = None) -> None:
    """Say how the emergency or the final snapshot of ``step`` went: ``saved`` (its short ID),
    or ``error`` (``latest``: the latest committed step)."""
    if error is None:
        if emergency:
            log.warning("Emergency snapshot at step %d saved (%s); exiting (run the job again "
                        "to resume from it)", step, saved)
        else:
            log.info("Final snapshot at step %d saved (%s)", step, saved)
    elif emergency:
        log.error("Emergency snapshot at step %d failed: %s", step, error)
    else:
        log.error("the final snapshot at step %d failed (%s); %s", step, error,
                  "this run committed no snapshot and restored none" if latest is None
                  else f"the latest snapshot is step {latest}")


if SnapshotManager.__doc__ is not None:  # None under python -OO
    SnapshotManager.__doc__ += "\n" + options_doc()


def resuming(info: SnapshotInfo, world: int) -> str:
    """The line that says where training resumes, and on how many ranks where the snapshot
    was taken on another number of them."""
    if world != info.world_size:
        return (f"Resuming training at step {info.step + 1} on {world} ranks (the snapshot was "
                f"taken on {info.world_size})")
    return f"Resuming training at step {info.step + 1}"
