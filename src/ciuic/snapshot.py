"""``SnapshotManager``: the one object a training loop talks to.

    from ciuic.snapshot import SnapshotManager
    manager = SnapshotManager(project_id="deepseek_v2", save_interval=1000)
    start = (manager.restore(model, optimizer) or -1) + 1
    for step in range(start, total_steps):
        ...  # forward, backward, optimizer.step()
        manager.step(step, model, optimizer)

A step number is the step whose optimizer update has just been applied; a snapshot taken at step
N holds the state after N's update, and a resumed run continues at N + 1.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import secrets
import signal
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any

import torch

from . import knobs, runs
from . import manifest as mf
from .capture import (
    capture,
    check_loadable,
    check_optimizer_state,
    load_object,
    match_model_state,
    set_rng_state,
)
from .catalog.models import Run
from .crypto import MissingKey, ObjectCodec
from .dist import Collective
from .distsave import (
    DistCaptured,
    Prepared,
    capture_dist,
    check_shared_store,
    is_distributed,
    layout_signature,
    leaf_key,
    predicted_owned,
    prepare,
    write_dist,
)
from .engine import StagingArea, StagingBudgetExceeded
from .engine.background import lower_priority
from .engine.compression import MODES as COMPRESSION_MODES
from .engine.compression import CompressionPolicy
from .engine.staging import PendingCopy
from .errors import (
    CiuicError,
    ConfigurationError,
    CorruptObject,
    IntegrityError,
    ObjectNotFound,
    RankError,
    RestoreError,
    StateMismatch,
)
from .gc import collect
from .info import SnapshotInfo
from .lease import FencedOut, Lease
from .lease import acquire as acquire_lease
from .reader import load_trees, read_body
from .repo import Repository, cached_catalog_url
from .retention import prune
from .shards import Meta
from .store import Store
from .store.mirror import MirrorStore
from .transfer import copy_job
from .tree import Leaf
from .writer import Captured, ChunkCache, write_snapshot

log = logging.getLogger("ciuic")


def _ensure_log_handler() -> None:
    """Show ciuic's INFO lines (the recovery log) when the application configured no logging."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(levelname)s] %(message)s"))
    handler.set_name("ciuic")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _quiet_other_ranks(rank: int) -> None:
    """Multi-rank: rank 0 alone prints the recovery log; the others print warnings and errors,
    marked with their rank (only through the handler ciuic installed itself)."""
    for handler in log.handlers:
        if handler.get_name() == "ciuic" and rank != 0:
            handler.setLevel(logging.WARNING)
            handler.setFormatter(logging.Formatter(f"[%(levelname)s rank {rank}] %(message)s"))


@dataclass
class ManagerStats:
    snapshots: int = 0
    failures: int = 0
    skipped: int = 0  # due while the previous snapshot was still being written (on_busy="skip")
    waited_s: float = 0.0  # training time spent waiting for a previous snapshot (on_busy="wait")
    last_stall_s: float = 0.0  # how long the last step()/save_async() blocked training
    consecutive_failures: int = 0
    bytes_total: int = 0
    bytes_new: int = 0  # new chunk bytes of the committed snapshots (every rank's)
    bytes_written: int = 0  # of those, the bytes this process wrote (multi-rank: its share)
    last_save_s: float = 0.0  # from the call until committed
    last_error: str = ""
    overlap_wait_s: float = 0.0  # optimizer steps held back until an overlapped copy finished
    last_staged_bytes: int = 0  # what the last snapshot copied into staging buffers


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    """The parameters of a module, or every tensor in an optimizer's state (a DTensor's local
    shard: that is the memory the staging copies)."""
    found: list[torch.Tensor] = []
    if isinstance(obj, torch.nn.Module):
        found = list(obj.parameters())
    elif isinstance(obj, torch.optim.Optimizer):
        found = [v for st in obj.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor)]
    return [t.to_local() if type(t).__name__ == "DTensor" else t  # type: ignore[attr-defined]
            for t in found]


def _sharded(model: Any) -> bool:
    """Whether a model holds DTensors (FSDP2, tensor parallel): then its snapshots take the
    multi-rank layout (sharded descriptors), even on a world of one."""
    return isinstance(model, torch.nn.Module) and any(
        type(p).__name__ == "DTensor" for p in model.parameters())


def _positive(name: str, value: float | None) -> None:
    if value is not None and (not isinstance(value, (int, float)) or value <= 0):
        raise ConfigurationError(f"{name} must be a positive number or None, got {value!r}")


class SnapshotManager:
    """Snapshots a training job as it runs and restores it after an interruption.

    Args:
        project_id: the project (a name: letters, digits, ``.``, ``_``, ``-``).
        api_key: the key for a ciuic server (or ``CIUIC_API_KEY``); unused with the embedded
            store.
        save_interval: snapshot when ``step % save_interval == 0`` (None or 0: never by steps).
        encryption: seal every object with AES-256-GCM on the client, with the key from
            ``CIUIC_ENCRYPTION_KEY`` or ``CIUIC_ENCRYPTION_KEY_FILE`` (``ciuic keygen``).
        job: the job within the project (default ``"default"``). The same project and job
            restarted means the same chain.
        store: a directory, a URL or a :class:`~ciuic.store.Store`; default ``$CIUIC_HOME``,
            else ``./.ciuic``.
        time_interval_s: also snapshot when this many seconds passed since the last one.
        keep_last: keep only the N snapshots with the highest steps (plus ``keep_every``).
        keep_every: also keep every snapshot whose step is a multiple of K.
        handle_signals: on SIGTERM/SIGINT, snapshot at the next ``step()`` and exit.
        asynchronous: ``step()`` blocks only while the state is copied into reused host
            buffers; chunking, hashing, writing and the commit run in a background thread.
            With False, ``step()`` returns once the snapshot is committed.
        on_busy: what ``step()`` does when a snapshot is due while the previous one is still
            being written: ``"wait"`` for it (the default, like Orbax: every due snapshot is
            taken; the wait is logged once) or ``"skip"`` the new one (counted in
            ``stats.skipped``; training never waits).
        staging_budget_bytes: the most host memory the staging buffers may take (default: the
            state's size). A state over the budget is written synchronously, with a warning.
        mirror: a second, durable tier (e.g. ``"s3://bucket/prefix"``; or ``$CIUIC_MIRROR``)
            that every object is mirrored to; restores fall back to it when the store has lost
            or damaged an object.
        durability: with a mirror, when a snapshot counts as committed: ``"local"`` (the
            default; uploaded in the background, in write order) or ``"remote"`` (once the
            mirror holds it).
        overlap: (opt-in, asynchronous only) copy the parameters and optimizer state while the
            next forward/backward runs instead of inside ``step()``; the optimizer's next
            ``step()`` waits for the copy to finish (a step pre-hook). Only the optimizer may
            change parameters or optimizer state between ``manager.step()`` and the next
            ``optimizer.step()``; buffers, RNG and extras are still copied inside ``step()``.
        endpoint: a ciuic server (``ciuic serve``), e.g. ``"https://ciuic.example.com"``; or
            ``CIUIC_ENDPOINT``. The project's snapshots then live on the server; everything
            else (encryption, incremental uploads, restore) works as with a local store.
        distributed: under ``torchrun`` (an initialized process group of two or more ranks)
            snapshots are multi-rank and every rank must build its manager at the same point
            (default: detected). ``False``: this process snapshots alone, as if it were the only
            one (e.g. a manager built on rank 0 only, for rank 0's own state).
        compression: lossless float compression of chunks (byte planes, ``ciuic.floatcodec``):
            ``"auto"`` (compress a float kind when the store is slow enough for it to pay, see
            ``ciuic.engine.compression``), ``"on"`` or ``"off"``.
    """

    def __init__(self, project_id: str, api_key: str | None = None,
                 save_interval: int | None = 1000, encryption: bool = False, *,
                 job: str | None = None,
                 store: str | os.PathLike[str] | Store | None = None,
                 time_interval_s: float | None = None,
                 keep_last: int | None = None, keep_every: int | None = None,
                 handle_signals: bool = True, asynchronous: bool = True,
                 on_busy: str = "wait", staging_budget_bytes: int | None = None,
                 mirror: str | Store | None = None, durability: str | None = None,
                 compression: str = "auto", overlap: bool = False,
                 endpoint: str | None = None, distributed: bool | None = None) -> None:
        self.project = mf.check_name("project", project_id)
        self.job = mf.check_name("job", job or "default")
        _positive("time_interval_s", time_interval_s)
        if save_interval is not None and (not isinstance(save_interval, int) or save_interval < 0):
            raise ConfigurationError(f"save_interval must be a step count >= 0 or None, "
                                     f"got {save_interval!r}")
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"{name} must be an integer >= 1 or None, got {value!r}")
        endpoint = endpoint or os.environ.get("CIUIC_ENDPOINT") or None
        if endpoint is not None and store is not None:
            raise ConfigurationError("pass either store= or a server endpoint (endpoint= or "
                                     "CIUIC_ENDPOINT), not both")
        if compression not in COMPRESSION_MODES:
            raise ConfigurationError(f"compression must be one of {COMPRESSION_MODES}, got "
                                     f"{compression!r}")
        if on_busy not in ("skip", "wait"):
            raise ConfigurationError(f"on_busy must be 'skip' or 'wait', got {on_busy!r}")
        self.api_key = api_key
        self.asynchronous = asynchronous
        self.on_busy = on_busy
        self._staging = StagingArea(staging_budget_bytes)
        self._reserved = False  # staging buffers allocated ahead of the first snapshot
        #: multi-rank: (this rank's layout signature, the pieces it wrote) of the last snapshot
        self._owned: tuple[tuple[int, list[Meta]], set[str]] | None = None
        self._predict_owners = True  # off for the snapshot after a failed one
        self.overlap = overlap
        self._pending_copy: PendingCopy | None = None
        #: id(optimizer) -> (the optimizer, weakly; its step pre-hook's handle)
        self._hooks: dict[int, tuple[weakref.ref[Any], Any]] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ciuic-snapshot",
                                            initializer=lower_priority)
        self._inflight: Future[SnapshotInfo] | None = None
        self._last_committed_step: int | None = None
        self._warned_budget = False
        self._warned_busy = False
        self._warned_steps = False
        self._agreement: Callable[[], list[int]] | None = None
        self._agreed_signal = False
        self._step_calls = 0
        self._dist_seq = 0  # multi-rank snapshots attempted: every rank counts the same
        self._steps_disagree = False
        self.save_interval = save_interval or None
        self.time_interval_s = time_interval_s
        self.keep_last = keep_last
        self.keep_every = keep_every
        _ensure_log_handler()

        # ciuic's own gloo groups under torchrun (every rank builds its manager); trivial in a
        # single process or with distributed=False
        self.coll = Collective(None if distributed is None else bool(distributed))
        if self.coll.enabled:
            _quiet_other_ranks(self.coll.rank)
        self.coll.run("opening the store", lambda: self._open_repo(
            store, endpoint, api_key, mirror, durability))
        self._codec = ObjectCodec(self.repo.keyring if encryption else None)
        # a local disk measures itself once per job (rank 0: not 256 MiB more per rank), now
        # in the background rather than during a snapshot; other ranks use the default
        probe = self.coll.coordinator
        store = self.repo.store
        self._compression = CompressionPolicy(compression,
                                              lambda: store.write_speed(measure=probe))
        if compression == "auto" and probe:
            threading.Thread(target=self._quietly, name="ciuic-probe", daemon=True,
                             args=("measure the store's write speed", store.write_speed)).start()
        self.run_id = secrets.token_hex(8)
        self.previous_run: Run | None = None
        self.interrupted = False
        self.lease: Lease | None = None
        # rank 0 alone keeps the catalog, the lease and the mirror; its failure stops every rank
        if not self.coll.enabled:
            self._start_run()
        else:
            error = None
            if self.coll.coordinator:
                try:
                    self._start_run()
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
            shared = self.coll.broadcast([self.run_id, self.interrupted, error])
            self.run_id, self.interrupted = shared[0], shared[1]
            if shared[2]:
                raise RankError("starting the run", {0: str(shared[2])})
            if on_busy == "skip" and self.coll.coordinator:
                log.warning("on_busy='skip' is not used under torchrun: skipping would have to "
                            "be agreed by every rank, so a due snapshot waits for the previous "
                            "one on every rank instead")
            check_shared_store(self.coll, self.repo.store, self.run_id)
        self._warn_if_taken_over()
        self.stats = ManagerStats()
        self.restored: SnapshotInfo | None = None
        self.restored_values: dict[str, Any] = {}
        self._parent = ""
        self._restore_called = False
        self._first_step_checked = False
        self._last_save_step: int | None = None
        self._last_save_time = time.monotonic()
        self._last_heartbeat = 0.0
        self._cache = ChunkCache()
        self._signal: int | None = None
        self._closed = False
        runs.track(self)
        #: the handlers ours replaced, kept after close: a closed manager's handler, still
        #: held by another's chain, passes signals on to them
        self._prev_handlers: dict[int, Any] = {}
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._prev_handlers[sig] = signal.getsignal(sig)
                signal.signal(sig, self._on_signal)

    def _open_repo(self, store: str | os.PathLike[str] | Store | None, endpoint: str | None,
                   api_key: str | None, mirror: str | Store | None,
                   durability: str | None) -> None:
        if endpoint is not None:  # a ciuic server: this project's objects over HTTP
            from .store.http import HttpStore

            server = HttpStore(endpoint, self.project, api_key)
            self.repo = Repository.open(server, cached_catalog_url(server.url), mirror=mirror,
                                        durability=durability)
        else:
            self.repo = Repository.open(store, mirror=mirror, durability=durability,
                                        writable=True)

    def _start_run(self) -> None:
        """Rank 0 (or the single process): index the job, record the run, take the lease,
        catch the mirror up."""
        self.repo.sync_job(self.project, self.job)
        self.previous_run = self.repo.catalog.start_run(self.project, self.job, self.run_id)
        self.interrupted = runs.was_interrupted(self.previous_run)
        self.lease = acquire_lease(self.repo.store, self.project, self.job, self.run_id)
        self._catch_up_mirror()

    def _warn_if_taken_over(self) -> None:
        prev, lease = self.previous_run, self.lease
        if prev is not None and lease is not None and runs.may_still_run(prev):
            log.warning(
                "job %s/%s may still be running in another process (pid %s on %s, run %s, last "
                "seen %s). This process takes the job over (lease %d): the other one can no "
                "longer commit snapshots and will say so. Stop it if it is still running.",
                self.project, self.job, prev.pid, prev.host, prev.id, prev.last_seen,
                lease.token)

    def _catch_up_mirror(self) -> None:
        """On a mirror, send in the background what an earlier run left unmirrored."""
        mirror = self.repo.store
        if not isinstance(mirror, MirrorStore) or mirror.durability != "local":
            return
        fast = Repository(mirror.fast, self.repo.catalog)

        def catch_up() -> None:
            try:
                stats = copy_job(fast, mirror.remote, self.project, self.job, verify=False)
            except Exception as e:  # never fatal: the next run tries again
                log.warning("catching up the mirror %s failed: %s", mirror.remote.url, e)
                return
            if stats.sent:
                log.info("mirror %s caught up: %d snapshot(s), %d object(s) sent",
                         mirror.remote.url, stats.snapshots, stats.sent)

        mirror.submit(catch_up)

    # -- the training loop's calls -----------------------------------------------------------

    def step(self, step: int, model: Any = None, optimizer: Any = None, **extras: Any) -> bool:
        """Call after the optimizer update of ``step``; snapshots when due.

        Returns whether a snapshot was taken: started (its state staged, the write running in
        the background) when ``asynchronous``, committed otherwise. A failure to snapshot never
        stops training: it is logged, counted in ``stats``, and the previous snapshot stays the
        latest.
        """
        self._check_open()
        if not self._first_step_checked:
            self._first_step_checked = True
            self._warn_if_not_resuming(step)
        now = time.monotonic()
        if self.coll.enabled:
            try:
                if not self._agree_step(step, now):  # every rank decides the same, together
                    return False
                if self._agreed_signal:  # not a local signal alone: every rank stops here
                    self._emergency(step, model, optimizer, extras)
                return self._take(step, now, model, optimizer, extras)
            finally:
                if not self._closed:
                    self._post_agreement(step)
        if self._signal is not None:
            self._emergency(step, model, optimizer, extras)
        if not self._due(step, self._time_due(now)):
            self._heartbeat(step, now)
            if not self._reserved:
                self._reserve_staging(model, optimizer, extras)
            return False
        return self._take(step, now, model, optimizer, extras)

    def _reserve_staging(self, model: Any, optimizer: Any, extras: dict[str, Any]) -> None:
        """At the first ``step()`` that is given state and takes no snapshot: allocate the
        staging buffers on a background thread, so that the first snapshot only copies
        (allocating 5.6 GB of pinned memory takes 2.9 s on the H200, the copy 0.1 s)."""
        if model is None and optimizer is None and not extras:
            return
        self._reserved = True
        if not self.asynchronous or _sharded(model):
            return  # sharded layouts allocate at their first snapshot
        try:
            leaves = capture(model, optimizer, extras).leaves
            self._staging.reserve([(leaf.path, leaf.nbytes) for leaf in leaves],
                                  pin=StagingArea.pin_device(leaves))
        except Exception as e:  # the first snapshot allocates them instead
            log.debug("staging buffers not reserved ahead: %s", e)

    def _take(self, step: int, now: float, model: Any, optimizer: Any,
              extras: dict[str, Any]) -> bool:
        """A snapshot is due: take it (the rest of :meth:`step`)."""
        self._heartbeat(step, now)
        if model is None and optimizer is None and not extras:
            log.warning("step(%d): a snapshot is due but step() was given no state to save "
                        "(pass the model and optimizer)", step)
            return False
        if self._busy():
            if self.on_busy == "skip" and not self.coll.enabled:
                self.stats.skipped += 1
                if not self._warned_busy:
                    self._warned_busy = True
                    log.warning("snapshot at step %d skipped: the previous one is still being "
                                "written (last took %.2f s). Snapshots are skipped, not queued, "
                                "while one is in flight; see stats.skipped, or pass "
                                "on_busy='wait'", step, self.stats.last_save_s)
                return False
            t0 = time.perf_counter()
            self.wait()
            waited = time.perf_counter() - t0
            self.stats.waited_s += waited
            if not self._warned_busy and waited > 0.05:
                self._warned_busy = True
                log.warning("snapshot at step %d waited %.2f s for the previous one to be "
                            "written: snapshots are due faster than they are written. Consider "
                            "a larger save_interval, or on_busy='skip'", step, waited)
        try:  # never let a snapshot failure stop training
            future = self._submit(step, model, optimizer, extras, inline=not self.asynchronous)
        except Exception as e:
            self._failed(step, e)
            return False
        if not self.asynchronous:
            try:
                future.result()
            except Exception:
                return False  # already logged and counted by the writer
        return True

    def _heartbeat(self, step: int, now: float) -> None:
        if self.coll.coordinator and now - self._last_heartbeat >= knobs.get(
                ).heartbeat_interval_s:
            self._last_heartbeat = now
            self._quietly("record progress", self.repo.catalog.heartbeat, self.run_id, step)

    def _agree_step(self, step: int, now: float) -> bool:
        """Multi-rank: whether a snapshot (or the emergency one) is due, decided identically on
        every rank.

        A step count makes a snapshot due on every rank at once. What one rank alone can see (a
        signal, the elapsed time interval) is shared by a small all-reduce that every rank
        starts at the end of every ``dist_agree_every_steps``-th ``step()`` without waiting for
        it (:meth:`_post_agreement`) and reads at the next ``step()``: its latency hides behind
        a training step, and every rank acts on the same values at the same step.
        """
        self._step_calls += 1
        sig = due_t = 0
        pending, self._agreement = self._agreement, None
        if pending is not None:
            sig, due_t, hi, neg_lo = pending()
            if sig:  # a signal on any rank stops every rank here, agreeing steps or not
                self._signal = self._signal or sig
                self._agreed_signal = True
                return True
            if hi != -neg_lo:
                if not self._warned_steps:
                    self._warned_steps = True
                    log.error("ranks called step() with different steps (%d to %d): no snapshot "
                              "is taken until they agree; call manager.step(step, ...) with the "
                              "same step on every rank", -neg_lo, hi)
                self._steps_disagree = True
                return False
            self._steps_disagree = False
        if self._steps_disagree:
            return False
        if not self._due(step, bool(due_t)):
            self._heartbeat(step, now)
            return False
        return True

    def _post_agreement(self, step: int) -> None:
        """Start the all-reduce that the next ``step()`` reads (see :meth:`_agree_step`)."""
        if (self._step_calls - 1) % knobs.get().dist_agree_every_steps:
            return
        time_due = self._time_due(time.monotonic())
        self._agreement = self.coll.start_max([self._signal or 0, int(time_due), step, -step])

    def _failed(self, step: int, e: BaseException) -> None:
        self.stats.failures += 1
        self.stats.consecutive_failures += 1
        self.stats.last_error = str(e) or type(e).__name__
        latest = (f"step {self._last_committed_step}" if self._last_committed_step is not None
                  else "none")
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: the process stops
            log.warning("snapshot at step %d interrupted (%s); the latest snapshot is %s",
                        step, type(e).__name__, latest)
            return
        level = logging.CRITICAL if self.stats.consecutive_failures >= 3 or isinstance(
            e, FencedOut) else logging.ERROR
        log.log(level, "snapshot at step %d failed (%s); training continues, the latest "
                "snapshot is still %s (%d failure(s) in a row)", step,
                str(e) or type(e).__name__, latest, self.stats.consecutive_failures)

    def _busy(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def _due(self, step: int, time_due: bool) -> bool:
        """Whether step ``step`` takes a snapshot: by its number, or because ``time_due``."""
        if step == self._last_save_step:
            return False
        return bool(self.save_interval and step % self.save_interval == 0) or time_due

    def _time_due(self, now: float) -> bool:
        """Whether ``time_interval_s`` has passed since the last snapshot."""
        return bool(self.time_interval_s and now - self._last_save_time >= self.time_interval_s)

    def save(self, step: int, model: Any = None, optimizer: Any = None,
             **extras: Any) -> SnapshotInfo:
        """Snapshot now, wait until it is committed, and return its info. Raises on failure
        (unlike :meth:`step`)."""
        self._check_open()
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
        self.wait()
        return self._submit(step, model, optimizer, extras)

    def _submit(self, step: int, model: Any, optimizer: Any, extras: dict[str, Any],
                inline: bool = False) -> Future[SnapshotInfo]:
        """Capture and stage; then write on the (lowered) writer thread, or with ``inline`` or
        when nothing could be staged, on this thread before returning."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigurationError(f"step must be a non-negative integer, got {step!r}")
        t0 = time.perf_counter()
        staged = False
        pending: PendingCopy | None = None
        self._reserved = True  # a snapshot allocates its own buffers: none to reserve after it
        try:
            captured = (capture_dist(model, optimizer, extras) if self.coll.enabled
                        or _sharded(model) else capture(model, optimizer, extras))
            leaves = captured.leaves
            if isinstance(captured, DistCaptured) and self.coll.enabled and self.asynchronous:
                leaves = self._leave_replicas_to_owners(captured)
            if self.asynchronous:
                self.stats.last_staged_bytes = sum(leaf.nbytes for leaf in leaves)
                try:
                    if self.overlap and optimizer is not None:
                        pending = self._stage_overlapped(leaves, model, optimizer)
                    else:
                        self._staging.stage(leaves)  # the only part that blocks
                    staged = True
                except StagingBudgetExceeded as e:
                    if not self._warned_budget:
                        self._warned_budget = True
                        log.warning("%s", e)
        except Exception as e:
            if not self.coll.enabled:
                raise
            # multi-rank: every rank must still take part in this snapshot's collectives;
            # the failure travels in the plan, and every rank fails the snapshot together
            captured = DistCaptured(states={}, leaves=[], error=f"{type(e).__name__}: {e}")
            staged = True
        self._last_save_step = step
        self._last_save_time = time.monotonic()
        if inline or not staged:  # (unstaged, it reads live tensors: finish before returning)
            future: Future[SnapshotInfo] = Future()
            try:
                future.set_result(self._write(step, captured, t0, pending))
            except Exception as e:  # logged and counted by _write; the caller may raise it
                future.set_exception(e)
        else:
            future = self._executor.submit(self._write, step, captured, t0, pending)
        self._inflight = future
        self.stats.last_stall_s = time.perf_counter() - t0
        return future

    def _leave_replicas_to_owners(self, captured: DistCaptured) -> list[Leaf]:
        """Multi-rank: the leaves this rank must copy. A replicated tensor (DDP) is written by
        one rank only; when this rank's layout is the one of the previous snapshot, the plan
        assigns the same owners, and before that, for plain (DDP) layouts, it can be predicted
        locally; so the replicas other ranks write are not copied here (the stall and the
        staging memory of a DDP rank shrink by the world size). After a failed snapshot the
        next one copies everything (no prediction) and learns the owners from the plan."""
        captured.signature = layout_signature(captured, self.coll.world_size)
        if self._owned is not None and self._owned[0] == captured.signature:
            owned: set[str] | None = self._owned[1]
        elif self._predict_owners:  # the first snapshot (or a new layout) of a DDP job
            owned = predicted_owned(captured, self.coll.rank, self.coll.world_size)
        else:
            owned = None
        if owned is None:
            return captured.leaves
        captured.unstaged = {leaf_key(leaf) for leaf in captured.global_leaves} - owned
        return captured.to_stage()

    def _stage_overlapped(self, leaves: list[Leaf], model: Any, optimizer: Any) -> PendingCopy:
        """Stage what only the optimizer changes in the background, the rest now."""
        guarded: set[int] = set()
        for obj in (model, optimizer):
            for t in _tensors_of(obj):
                guarded.add(t.untyped_storage().data_ptr())
        hooked = self._hooks.get(id(optimizer))
        if hooked is None or hooked[0]() is not optimizer:  # a new optimizer may reuse an id
            self._hooks[id(optimizer)] = (weakref.ref(optimizer),
                                          optimizer.register_step_pre_hook(
                                              self._before_optimizer_step))
        pending = self._staging.stage_overlapped(
            leaves, lambda leaf: isinstance(leaf.value, torch.Tensor)
            and leaf.value.untyped_storage().data_ptr() in guarded)
        self._pending_copy = pending
        return pending

    def _before_optimizer_step(self, *_: Any) -> None:
        pending, self._pending_copy = self._pending_copy, None
        if pending is not None:
            t0 = time.perf_counter()
            with contextlib.suppress(Exception):  # the writer reports it; training goes on
                pending.wait()
            self.stats.overlap_wait_s += time.perf_counter() - t0

    def _write(self, step: int, captured: Captured, t0: float,
               pending: PendingCopy | None = None) -> SnapshotInfo:
        """The background part: chunks, body, commit, catalog, retention (writer thread)."""
        try:
            if pending is not None:
                try:
                    pending.wait()
                except Exception as e:
                    if not isinstance(captured, DistCaptured):
                        raise
                    captured.error = f"{type(e).__name__}: {e}"  # goes into the plan
            if isinstance(captured, DistCaptured):
                self._dist_seq += 1
                m, sid, written = write_dist(self.coll, self.repo, self.project, self.job, step,
                                             self._parent, captured, self._cache,
                                             lease=self.lease, codec=self._codec,
                                             compression=self._compression,
                                             seq=self._dist_seq)
            else:
                m, sid = write_snapshot(self.repo, self.project, self.job, step, self._parent,
                                        captured, self._cache, lease=self.lease,
                                        codec=self._codec, compression=self._compression)
                written = m.new_bytes
        except BaseException as e:
            self._owned = None  # the next snapshot copies everything
            self._predict_owners = False
            self._failed(step, e)
            raise
        if isinstance(captured, DistCaptured):
            self._owned = (None if captured.signature is None
                           else (captured.signature, captured.owned))
            self._predict_owners = True
        self._parent = sid
        self._last_committed_step = step
        self.stats.snapshots += 1
        self.stats.consecutive_failures = 0
        self.stats.bytes_total += m.total_bytes
        self.stats.bytes_new += m.new_bytes
        self.stats.bytes_written += written
        self.stats.last_save_s = time.perf_counter() - t0
        # The snapshot is committed: what follows is bookkeeping and must not make it look failed.
        if not self.coll.coordinator:
            return SnapshotInfo.from_manifest(m, sid)
        self._quietly("record the snapshot event", self.repo.catalog.event, self.run_id,
                      self.project, self.job, "snapshot", step, sid)
        if self.keep_last is not None or self.keep_every is not None:
            self._quietly("apply retention", self._apply_retention, sid)
        return SnapshotInfo.from_manifest(m, sid)

    def _quietly(self, what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:
            log.warning("could not %s (training and snapshots go on): %s", what, e)

    def _apply_retention(self, current: str) -> None:
        pruned = prune(self.repo, self.project, self.job, self.keep_last, self.keep_every,
                       protect=[current])
        if pruned:
            result = collect(self.repo)  # skips when a save is in flight or data is damaged
            log.debug("retention pruned %d snapshot(s); gc deleted %d chunk(s) %s", len(pruned),
                      result.deleted_chunks, result.skipped)

    def wait(self) -> None:
        """Block until every started snapshot is durable and committed (or has failed: failures
        are logged and counted in ``stats``, not raised here), and until staging buffers being
        allocated ahead of the first snapshot are ready."""
        self._staging.join()
        if self._inflight is not None:
            concurrent.futures.wait([self._inflight])

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
        """
        self._check_open()
        self.wait()
        self._restore_called = True
        candidates = self._candidates(snapshot)
        if not candidates:
            log.info("No snapshot of %s/%s in %s: starting from scratch", self.project, self.job,
                     self.repo.location())
            return None
        skip = {n for n, obj in (("model", model), ("optimizer", optimizer)) if obj is None}
        buffer_for = self._restore_buffers(model)
        problems: list[str] = []
        for info in candidates:
            log.info("Found snapshot at step %d, timestamp: %sZ", info.step, info.created[:19])
            log.info("Downloading snapshot from %s",
                     self.repo.location(mf.manifest_key(info.project, info.job, info.id)))
            outcome, detail = "ok", ""
            prepared: Prepared | None = None
            states: dict[str, Any] = {}
            try:
                _, trees = read_body(self.repo, info)
                if is_distributed(trees):
                    prepared = prepare(self.repo, trees, model, optimizer, extras,
                                       self.coll.rank, self.coll.world_size)
                else:
                    states = load_trees(self.repo, {k: v for k, v in trees.items()
                                                    if k not in skip}, buffer_for)
            except MissingKey as e:  # not damage: an older snapshot is no answer to it
                outcome, detail = "error", f"{e}; nothing was restored"
            except (IntegrityError, ObjectNotFound) as e:
                outcome, detail = "damaged", str(e)
                self._suspect(e)
            except (StateMismatch, ConfigurationError) as e:
                outcome, detail = "mismatch", str(e)
            except Exception as e:
                if not self.coll.enabled:
                    raise
                outcome, detail = "error", f"{type(e).__name__}: {e}"  # every rank stops
            outcome, detail = self._agree_restore(outcome, detail)
            if outcome == "mismatch":
                raise StateMismatch(detail)
            if outcome == "error":
                raise RestoreError(f"restoring snapshot {info.short_id} failed:\n{detail}")
            if outcome == "damaged":
                problems.append(f"step {info.step} ({info.short_id}): {detail}")
                if snapshot is not None:
                    raise RestoreError(f"snapshot {info.short_id} cannot be restored: {detail}")
                log.warning("Snapshot at step %d (%s) is damaged: %s; falling back to the "
                            "previous snapshot", info.step, info.short_id, detail)
                continue
            if prepared is not None:
                prepared.apply()
                self._mark_restored(info, prepared.values)
            else:
                self._apply(info, states, model, optimizer, extras)
            return info.step
        raise RestoreError(
            f"job {self.project}/{self.job} has {len(candidates)} snapshot(s) but none could be "
            "restored:\n  " + "\n  ".join(problems) + "\nRun `ciuic verify --deep "
            f"{self.project}/{self.job}` for details; refusing to start from scratch."
        )

    def _suspect(self, e: Exception) -> None:
        """A chunk a restore found damaged (not merely sealed with another key, nor written by
        a newer ciuic) is written again by the next snapshot that holds its bytes: without
        this, every later snapshot would reuse the damaged copy as already stored."""
        if (isinstance(e, CorruptObject) and not isinstance(e, MissingKey)
                and e.key.startswith("chunks/") and "newer ciuic" not in e.reason
                and not e.reason.startswith("unsupported codec")):
            digest = e.key.rsplit("/", 1)[-1]
            self._cache.suspect.add(digest)
            self._cache.digests.discard(digest)  # "known to be stored" no longer holds
            log.warning("%s will be written again by the next snapshot that holds its bytes",
                        e.key)

    def _candidates(self, snapshot: str | None) -> list[SnapshotInfo]:
        """The snapshots to try, newest first. Multi-rank: rank 0 decides, every rank follows."""
        found: list[SnapshotInfo] = []
        error = None
        if self.coll.coordinator:
            try:
                if snapshot is not None:
                    found = [self.repo.resolve(snapshot)]
                else:
                    self.repo.sync_job(self.project, self.job)
                    found = self.repo.catalog.snapshots(self.project, self.job,
                                                        newest_first=True)
            except Exception as e:
                if not self.coll.enabled:
                    raise
                error = f"{type(e).__name__}: {e}"
            prev = self.previous_run
            if self.interrupted and prev is not None:
                # progress is recorded now and then: the last snapshot may be later
                steps = [s for s in (prev.last_step, *(i.step for i in found[:1]))
                         if s is not None]
                log.info("Detected training interruption at step %s (%s)",
                         max(steps) if steps else "unknown",
                         "no exit was recorded: it may still be running" if
                         runs.may_still_run(prev) else runs.describe_end(prev))
            log.info("Searching for latest snapshot...")
        if not self.coll.enabled:
            return found
        shared = self.coll.broadcast({"error": error, "found": [asdict(i) for i in found]})
        if shared["error"]:
            raise RestoreError(f"rank 0 could not list the snapshots: {shared['error']}")
        if self.coll.coordinator:
            return found
        return [SnapshotInfo(**info) for info in shared["found"]]  # what rank 0's catalog says

    def _agree_restore(self, outcome: str, detail: str) -> tuple[str, str]:
        """Multi-rank: the worst outcome of any rank, for every rank (a mismatch anywhere stops
        every rank; damage anywhere moves every rank to the previous snapshot)."""
        if not self.coll.enabled:
            return outcome, detail
        everyone = self.coll.all_gather([outcome, detail])
        for worst in ("error", "mismatch", "damaged"):
            ranks: dict[str, list[int]] = {}  # one line per distinct message
            for r, (o, d) in enumerate(everyone):
                if o == worst:
                    ranks.setdefault(d, []).append(r)
            if ranks:
                return worst, "\n".join(
                    f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {d}"
                    for d, rs in ranks.items())
        return "ok", ""

    def _restore_buffers(self, model: Any) -> Callable[[str, int], torch.Tensor | None] | None:
        """Lend the staging buffers to the model's tensors: ``load_state_dict`` copies out of
        them, and the first snapshot after the resume stages into them without allocating.
        Only the model's: an optimizer's ``load_state_dict`` keeps the tensors it is given."""
        if model is None or not self.asynchronous:
            return None
        live = _state_of_model(model)
        pin = next((t.device.index or 0 for t in live.values()
                    if isinstance(t, torch.Tensor) and t.is_cuda), None)

        def buffer_for(path: str, nbytes: int) -> torch.Tensor | None:
            if not path.startswith("model/"):
                return None
            return self._staging.lend(path, nbytes, pin)

        return buffer_for

    def _apply(self, info: SnapshotInfo, states: dict[str, Any], model: Any, optimizer: Any,
               extras: dict[str, Any]) -> None:
        # validate everything before touching any live object
        model_state = None
        if model is not None:
            if "model" not in states:
                raise StateMismatch(f"snapshot {info.short_id} holds no model state")
            target = model.state_dict()
            model_state = match_model_state(states["model"], target)
        if optimizer is not None:
            if "optimizer" not in states:
                raise StateMismatch(f"snapshot {info.short_id} holds no optimizer state")
            check_optimizer_state(states["optimizer"], optimizer)
        missing = [n for n in extras if n not in states]
        if missing:
            have = ", ".join(sorted(states)) or "nothing"
            raise StateMismatch(f"snapshot {info.short_id} has no state for {missing} "
                                f"(it has: {have}); pass only objects that were saved")
        for name, obj in extras.items():
            check_loadable(name, obj)
        # extras first: their load_state_dict may still reject the state (a sampler over a
        # dataset of another length), and then the model and optimizer are untouched
        for name, obj in extras.items():
            load_object(name, obj, states[name])
        if model is not None:
            log.info("Loading model state...")
            model.load_state_dict(model_state)
        if optimizer is not None:
            log.info("Loading optimizer state...")
            optimizer.load_state_dict(states["optimizer"])
        if "rng" in states:
            set_rng_state(states["rng"])
        self._mark_restored(info, {k: v for k, v in states.items()
                                   if k not in ("model", "optimizer", "rng") and k not in extras})

    def _mark_restored(self, info: SnapshotInfo, values: dict[str, Any]) -> None:
        self.restored_values = values
        self.restored = info
        same_job = (info.project, info.job) == (self.project, self.job)
        self._parent = info.id if same_job else ""
        self._last_save_step = self._last_committed_step = info.step
        self._last_save_time = time.monotonic()
        if self.coll.coordinator:
            self.repo.catalog.event(self.run_id, self.project, self.job, "restore", info.step,
                                    info.id)
        log.info("Resuming training at step %d", info.step + 1)

    # -- start-up checks, signals, lifecycle -------------------------------------------------

    def _warn_if_not_resuming(self, step: int) -> None:
        if self._restore_called:
            return
        latest = self.repo.catalog.latest(self.project, self.job)
        if latest is None:
            return
        how = ("the previous run was interrupted: " + runs.describe_end(self.previous_run)
               if self.interrupted and self.previous_run is not None else "")
        log.warning(
            "!!! job %s/%s already has snapshots (latest at step %d, %s) but this run did not "
            "call restore(): it is NOT resuming. It trains from step %d and its snapshots start "
            "a new lineage; the old ones are kept. %s To resume, call "
            "manager.restore(model, optimizer) before the loop.",
            self.project, self.job, latest.step, latest.created[:19] + "Z", step,
            (how + ".") if how else "",
        )

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._closed:  # reached through another handler's chain: not ours any more
            _pass_on(_unchained(self._prev_handlers.get(signum, signal.SIG_DFL), signum), signum,
                     frame)
            return
        name = signal.Signals(signum).name
        if self._signal is not None:  # a second signal: stop now
            self._record_end(f"signal:{name}")
            self._restore_handlers()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self._signal = signum
        log.warning("%s received: taking an emergency snapshot at the next step() and exiting "
                    "(send %s again to exit at once)", name, name)

    def _emergency(self, step: int, model: Any, optimizer: Any, extras: dict[str, Any]) -> None:
        assert self._signal is not None
        name = signal.Signals(self._signal).name
        self.wait()
        if step != self._last_committed_step and (model is not None or optimizer is not None):
            try:
                info = self.save(step, model, optimizer, **extras)
                log.warning("Emergency snapshot at step %d saved (%s); exiting", step,
                            info.short_id)
            except (CiuicError, OSError) as e:
                log.error("Emergency snapshot at step %d failed: %s", step, e)
        self._record_end(f"signal:{name}", step)
        code = 128 + self._signal
        self.close()
        raise SystemExit(code)

    def _restore_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._prev_handlers.items():
            if signal.getsignal(sig) == self._on_signal:  # else a later manager's is on top
                signal.signal(sig, _unchained(handler, sig))

    def _record_end(self, kind: str, step: int | None = None) -> None:
        if not self.coll.coordinator:
            runs.untrack(self)
            return
        try:
            self.repo.catalog.end_run(self.run_id, kind, step)
        except Exception as e:  # the catalog may be gone at interpreter exit
            log.debug("could not record the end of run %s: %s", self.run_id, e)
        runs.untrack(self)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError("this SnapshotManager is closed; create a new one")

    def close(self) -> None:
        """Finish: record a clean end of the run and release resources. Idempotent."""
        if self._closed:
            return
        self.wait()
        self._executor.shutdown(wait=True)
        if self._agreement is not None:  # every rank started it; let it finish before the
            with contextlib.suppress(Exception):  # groups go (a dead peer fails it: ignore)
                self._agreement()
            self._agreement = None
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._staging.release()
        self._record_end("clean")
        self._restore_handlers()
        self._closed = True
        self.coll.close()
        self.repo.close()

    def __enter__(self) -> SnapshotManager:
        return self

    def __exit__(self, tp: type[BaseException] | None, value: BaseException | None,
                 tb: Any) -> None:
        if tp is not None and not issubclass(tp, SystemExit):
            self._record_end(f"exception:{tp.__name__}")
        self.close()


def _state_of_model(model: Any) -> Mapping[str, Any]:
    fn = getattr(model, "state_dict", None)
    state = fn() if callable(fn) else None
    return state if isinstance(state, Mapping) else {}


def _unchained(handler: Any, sig: int) -> Any:
    """``handler``, or for the handler of a closed manager the one it replaced (managers
    closed in another order than they were made leave no closed manager installed)."""
    while (getattr(handler, "__func__", None) is SnapshotManager._on_signal
           and handler.__self__._closed):
        handler = handler.__self__._prev_handlers.get(sig, signal.SIG_DFL)
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
