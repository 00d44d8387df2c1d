"""The snapshot pipeline: capture -> stage (the only stall) -> write in the background ->
commit -> bookkeeping. One interface (:class:`Pipeline`, an ABC generic in the captured state
it writes), two implementations chosen once when the manager is built: :class:`LocalPipeline`
for a process that snapshots alone, and :class:`~ciuic.manager.ranked.RankedPipeline` under
torchrun (replica ownership and the two-phase commit). One snapshot is in flight at a time: the
staging buffers are reused.
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import logging
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from ciuic.chain.health import HealthTracker
from ciuic.chain.read import read_chunk
from ciuic.chain.writer import ChunkCache, SnapshotWrite, write_snapshot
from ciuic.distributed.collective import Collective
from ciuic.distributed.messages import Plans
from ciuic.distributed.plan import DistCaptured, capture_dist
from ciuic.distributed.save import write_dist
from ciuic.engine import StagingArea
from ciuic.engine.compression import CompressionPolicy
from ciuic.engine.staging import PendingCopy
from ciuic.errors import (
    CaptureError,
    ConfigurationError,
    FencedOut,
    IntegrityError,
    ObjectNotFound,
    StagingBudgetExceeded,
)
from ciuic.format import layout
from ciuic.format import manifest as mf
from ciuic.format.crypto import ObjectCodec
from ciuic.format.descriptor import ChunkRef, TensorDescriptor
from ciuic.format.info import SnapshotInfo
from ciuic.format.tree import Leaf
from ciuic.manager.config import ManagerConfig
from ciuic.manager.session import RunSession, quietly
from ciuic.manager.stats import ManagerStats
from ciuic.state.capture import Captured, as_capture_error, capture
from ciuic.supervisor import inprocess
from ciuic.threads import lower_priority
from ciuic.words import counted

log = logging.getLogger("ciuic")
#: the captured state a pipeline writes
C = TypeVar("C", bound=Captured)


#: how long a fault's abandon waits for the snapshot in flight (its collectives fail at once)
ABANDON_WAIT_S = 10.0


class Pipeline(abc.ABC, Generic[C]):
    """Takes one snapshot at a time: :meth:`submit` runs the shared path, which calls the
    methods a pipeline implements (the abstract ones), in this order:

    1) :meth:`capture`, on the training thread: the state to snapshot, as a ``C`` whose leaves
       reference the live tensors.
    2) :meth:`to_stage` (asynchronous snapshots only): the leaves this process copies into its
       staging buffers; the copy is the only part that stalls training.
    3) :meth:`capture_failed`, only when 1) or 2) raised: raise the error, or return a ``C``
       that carries it into the write (under torchrun every rank takes part in every
       snapshot's collectives, and every rank fails it together).
    4) :meth:`write`, on the writer thread (or on the training thread before ``submit``
       returns, when inline or nothing could be staged): chunks, body and commit.
    5) :meth:`written`, after 4) returned (``ok``) or raised.

    What both pipelines share: staging, the writer thread, the snapshot in flight, the chunk
    cache, the codec and the compression policy, the parent link and the stats.
    """

    def __init__(self, config: ManagerConfig, session: RunSession, coll: Collective,
                 stats: ManagerStats, codec: ObjectCodec) -> None:
        self.config = config
        self.session = session
        self.coll = coll
        self.stats = stats
        self.repo = session.repo
        sup = session.supervised
        #: under ``ciuic run``: the staging buffers are the host-memory copy (single process)
        self.tier = sup.tier if sup is not None else None
        self.staging = StagingArea(config.staging_budget_bytes,
                                   allocator=self.tier.allocate if self.tier else None)
        if self.tier is not None and self.tier.adopted:
            self.staging.adopt(self.tier.adopted)
        self._publishable = False  # the buffers hold the snapshot being written
        self.cache = ChunkCache()
        #: judges each snapshot's health at its commit (None: health="off")
        self.health = None if config.health is None else HealthTracker(config.health)
        self.codec = codec
        store = self.repo.store
        probe = coll.coordinator  # other ranks use the default speed
        self.compression = CompressionPolicy(config.compression,
                                             lambda: store.write_speed(measure=probe),
                                             store.read_speed)
        stats.compression = self.compression.choice
        if config.compression == "auto" and probe:
            session.probe_write_speed()
        self.parent = ""  # the snapshot the next one links to
        self.last_committed_step: int | None = None
        self.reserved = False  # staging buffers allocated ahead of the first snapshot
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ciuic-snapshot",
                                            initializer=lower_priority)
        # its thread started now, not by the first snapshot's submit (3-4 ms of its stall);
        # one rank makes the chunks' directories of a fresh local store before the first
        # snapshot, not the first snapshot's write threads
        self._executor.submit(quietly, "prepare the store's chunk directories", store.expect,
                              layout.chunk_prefixes() if probe else [])
        self._inflight: Future[SnapshotInfo] | None = None
        self._pending_copy: PendingCopy | None = None
        #: id(optimizer) -> (the optimizer, weakly; its step pre-hook's handle)
        self._hooks: dict[int, tuple[weakref.ref[Any], Any]] = {}
        #: reads of the store's copies of chunks a rollback took from memory (the next write
        #: waits for them: a damaged copy must be distrusted before a snapshot reuses it)
        self._checks: list[Future[None]] = []
        self._warned_budget = False
        #: a failure that repeats at every snapshot (CaptureError), met by the writer: the
        #: next step() raises it
        self.fatal: CaptureError | None = None
        _finish_at_exit(self)

    # -- the protocol: what the two pipelines do differently ------------------------------

    @abc.abstractmethod
    def capture(self, model: Any, optimizer: Any, extras: dict[str, Any]) -> C:
        """The state to snapshot (references to live tensors; no copies, no I/O)."""

    @abc.abstractmethod
    def to_stage(self, captured: C) -> list[Leaf]:
        """The leaves of ``captured`` this process copies into staging buffers."""

    @abc.abstractmethod
    def capture_failed(self, e: Exception) -> C:
        """Capturing or staging raised ``e``: raise it, or return a state that carries it into
        :meth:`write`."""

    @abc.abstractmethod
    def write(self, step: int, captured: C) -> tuple[mf.Manifest, str, int]:
        """Chunks, body and commit; the manifest, the snapshot ID and the bytes written."""

    @abc.abstractmethod
    def written(self, captured: C, ok: bool) -> None:
        """After :meth:`write`, committed (``ok``) or not."""

    # -- the shared path -------------------------------------------------------------------

    def busy(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def wait(self, checks: bool = True) -> None:
        """Until the snapshot in flight is committed or failed, staging buffers being
        allocated ahead of the first snapshot are ready, and (``checks``) a rollback's check of
        the store's copies (:meth:`check_stored`) is done."""
        self.staging.join()
        if self._inflight is not None:
            concurrent.futures.wait([self._inflight])
        if checks:
            self._checked()

    def raise_fatal(self) -> None:
        """Raise the snapshot failure that repeats at every snapshot (a CaptureError), once
        this rank's writer has met it too (multi-rank: every rank's snapshot failed together,
        in its plan)."""
        self.wait()
        fatal, self.fatal = self.fatal, None
        raise fatal or CaptureError("another rank's snapshot failed in a way that repeats at "
                                    "every snapshot: that rank's error says why")

    def reserve_after_restore(self, model: Any, optimizer: Any, restored: bool) -> None:
        """After a restore (or none to make), the state's shape is known: allocate the staging
        buffers in the background, so that the first snapshot only copies, whether ``step()``
        or ``save_async()`` takes it (into fresh memory the copy of the 1 GiB state took
        0.08-4.7 s on the VM, its pages faulted in one by one; into buffers allocated ahead,
        0.04-0.06 s). With nothing restored, an optimizer has no state until its first step:
        ``step()`` reserves again then, for what appeared. Only the model's and optimizer's
        (the bytes): an extra's ``state_dict()`` may act on it before training has begun
        (torchdata's loader starts a pass, which draws from torch's RNG and shifted a resumed
        torchtitan run). Advice only: state that cannot be captured now (an optimizer that
        cannot describe itself before its first step, as Megatron's distributed one) is left
        for ``step()``, which raises where it must."""
        if self.reserved:
            return
        try:
            self.reserve(model, optimizer, {})
        except Exception as e:
            restored = False
            log.debug("staging buffers not reserved after the restore: %s", e)
        if not restored:  # step() reserves (again)
            self.reserved = False

    def reserve(self, model: Any, optimizer: Any, extras: dict[str, Any]) -> None:
        """At the first ``step()`` that is given state and takes no snapshot: check that the
        state can be captured, and allocate the staging buffers on a background thread, so that
        the first snapshot only copies (allocating 5.6 GB of pinned memory takes 2.9 s on the
        H200, the copy 0.1 s)."""
        if model is None and optimizer is None and not extras:
            return
        self.reserved = True
        if sharded(model):
            return  # sharded layouts allocate at their first snapshot
        # state that cannot be stored (CaptureError) is the caller's mistake: raised here, at
        # the first step(), not logged as a failed snapshot at every interval
        try:
            leaves = capture(model, optimizer, extras).leaves
        except Exception as e:
            error = as_capture_error(e)
            if error is not e:
                raise error from e
            if isinstance(e, (CaptureError, ConfigurationError)):
                raise
            log.debug("the state was not captured ahead of the first snapshot: %s", e)
            return  # a fault of the environment: the first snapshot meets it, or not
        if not self.config.asynchronous:
            return
        try:
            self.staging.reserve([(leaf.path, leaf.nbytes) for leaf in leaves],
                                 pin=StagingArea.pin_device(leaves))
        except Exception as e:  # the first snapshot allocates them instead
            log.debug("staging buffers not reserved ahead: %s", e)

    def submit(self, step: int, model: Any, optimizer: Any, extras: dict[str, Any],
               staged_hook: Callable[[], None], inline: bool = False) -> Future[SnapshotInfo]:
        """Capture and stage (then ``staged_hook()``); then write on the (lowered) writer
        thread, or with ``inline`` or when nothing could be staged, on this thread before
        returning."""
        t0 = time.perf_counter()
        staged = False
        pending: PendingCopy | None = None
        self.reserved = True  # a snapshot allocates its own buffers: none to reserve after it
        try:
            try:
                captured = self.capture(model, optimizer, extras)
            except Exception as e:  # one that repeats is a CaptureError, raised
                error = as_capture_error(e)
                if error is e:
                    raise
                raise error from e
            if self.config.asynchronous:
                leaves = self.to_stage(captured)
                self.stats.last_staged_bytes = sum(leaf.nbytes for leaf in leaves)
                self._publishable = False
                if self.tier is not None:  # the buffers change: no host copy until the commit
                    self.tier.invalidate()
                try:
                    if self.config.overlap and optimizer is not None:
                        pending = self._stage_overlapped(leaves, model, optimizer)
                    else:
                        self.staging.stage(leaves)  # the only part that blocks
                    staged = True
                    self._publishable = True
                except StagingBudgetExceeded as e:
                    if not self._warned_budget:
                        self._warned_budget = True
                        log.warning("%s", e)
        except Exception as e:
            captured = self.capture_failed(e)
            staged = True
        staged_hook()
        if inline or not staged:  # (unstaged, it reads live tensors: finish before returning)
            future: Future[SnapshotInfo] = Future()
            try:
                future.set_result(self._write(step, captured, t0, pending))
            except CaptureError:  # counted by _write; the state's mistake, on every rank
                self.fatal = None  # raised now
                raise
            except Exception as e:  # logged and counted by _write; the caller may raise it
                future.set_exception(e)
        else:
            future = self._executor.submit(self._write, step, captured, t0, pending)
        self._inflight = future
        self.stats.last_stall_s = time.perf_counter() - t0
        return future

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
        pending = self.staging.stage_overlapped(
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

    def _write(self, step: int, captured: C, t0: float,
               pending: PendingCopy | None = None) -> SnapshotInfo:
        """The background part: chunks, body, commit, catalog, retention (writer thread)."""
        began = time.perf_counter()
        self._checked()
        try:
            if pending is not None:
                try:
                    pending.wait()
                except Exception as e:
                    if not isinstance(captured, DistCaptured):
                        raise
                    captured.error = f"{type(e).__name__}: {e}"  # goes into the plan
            m, sid, written = self.write(step, captured)
        except BaseException as e:
            self.written(captured, ok=False)
            self.failed(step, e)
            raise
        self.written(captured, ok=True)
        self.parent = sid
        self.last_committed_step = step
        s = self.stats
        s.snapshots += 1
        s.consecutive_failures = 0
        s.bytes_total += m.total_bytes
        s.bytes_new += m.new_bytes
        s.bytes_written += written
        s.last_save_s = time.perf_counter() - t0
        self.compression.observe(written, time.perf_counter() - began)
        s.compression = self.compression.choice
        # The snapshot is committed: what follows is bookkeeping and must not make it look failed.
        if self.tier is not None and self._publishable:
            quietly("keep the snapshot in host memory", self.tier.publish, sid, step,
                    self.staging.buffers(), written_by_this(captured))
        self.session.committed(step, sid)
        return SnapshotInfo.from_manifest(m, sid)

    def check_stored(self, chunks: list[ChunkRef]) -> None:
        """Read the store's copies of ``chunks`` on the writer thread, before
        any later write: a restore took them from this process's memory, so it did not see
        them, and a damaged copy would be reused by every later snapshot holding its bytes. A
        damaged one is distrusted (the next snapshot holding its bytes writes it again), with
        a warning; training is not held up."""
        if chunks:
            self._checks.append(self._executor.submit(_check_stored, self.repo, self.cache,
                                                      chunks))

    def _checked(self) -> None:
        checks, self._checks = self._checks, []
        for check in checks:
            with contextlib.suppress(Exception):  # logged by the check
                check.result()

    def _latest(self) -> str:
        """The latest committed snapshot, as the messages say it."""
        return (f"step {self.last_committed_step}" if self.last_committed_step is not None
                else "none")

    def failed(self, step: int, e: BaseException) -> None:
        """Count and log a snapshot that failed; training goes on."""
        s = self.stats
        s.failures += 1
        s.consecutive_failures += 1
        s.last_error = str(e) or type(e).__name__
        s.last_failed_step = step
        latest = self._latest()
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: the process stops
            log.warning("snapshot at step %d interrupted (%s); the latest snapshot is %s",
                        step, type(e).__name__, latest)
            return
        self.session.failed(step, e)
        if isinstance(e, CaptureError):  # raised to the caller (now, or at the next step())
            self.fatal = self.fatal or e
            return
        # not the storage's fault, nor one to act on; the writer thread may wait a moment for
        # the generation's end (the training thread does not)
        wait_s = 0.0 if threading.current_thread() is threading.main_thread() else 2.0
        if inprocess.cut_short(wait_s):
            log.warning("snapshot at step %d cut short by the fault the job recovers from (%s); "
                        "the rollback goes to %s", step, str(e) or type(e).__name__, latest)
            return
        level = logging.CRITICAL if s.consecutive_failures >= 3 or isinstance(
            e, FencedOut) else logging.ERROR
        log.log(level, "snapshot at step %d failed (%s); training continues, the latest "
                "snapshot is still %s (%s in a row)", step, str(e) or type(e).__name__,
                latest, counted(s.consecutive_failures, "failure"))

    def snapshot_write(self, step: int) -> SnapshotWrite:
        """Where the snapshot at ``step`` goes and how it is written (both pipelines')."""
        c = self.config
        return SnapshotWrite(self.repo, c.project, c.job, step, self.parent, self.cache,
                             codec=self.codec, compression=self.compression,
                             health=self.health, lease=self.session.lease)

    def continue_from(self, info: SnapshotInfo, same_job: bool) -> None:
        """The next snapshot follows ``info`` (restored): it links to it when it is this
        job's (a snapshot of another job starts a new chain)."""
        self.parent = info.id if same_job else ""
        self.last_committed_step = info.step

    def adopt_plan(self, joint: str, others: dict[str, int]) -> None:
        """A restored multi-rank snapshot's plan, for this rank (``others``: the owner of each
        of its pieces another rank wrote), made from the layouts whose digest is ``joint``:
        the next snapshot reuses it when no rank's layout changed. Only ranked pipelines
        plan."""

    def abandon(self, wait_s: float = ABANDON_WAIT_S) -> None:
        """In-process recovery (:mod:`ciuic.supervisor.inprocess`): the snapshot in flight
        fails fast (its collectives are aborted) and is waited for ``wait_s`` at most; the
        buffers are dropped here and stay in ``ciuic run``'s host memory, published, for the
        next generation."""
        if self._inflight is not None:
            done, _ = concurrent.futures.wait([self._inflight], timeout=wait_s)
            if not done:
                log.warning("the snapshot in flight did not end within %g s of the fault; "
                            "left to end on its own (it cannot commit). Its thread is in %s",
                            wait_s, where_thread("ciuic-snapshot"))
        self._executor.shutdown(wait=False, cancel_futures=True)
        _live.discard(self)  # the process's exit does not wait for it either
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self.staging.release()

    def close(self) -> None:
        self.wait()  # the checks too
        if self.fatal is not None:  # no step() came after it to raise it
            log.error("the last snapshot failed: %s", self.fatal)
        s = self.stats
        if s.failures:  # said at the end too: a job that trained on without snapshots
            log.warning("%s of this run's %d failed, the last at step %s (%s); the latest "
                        "committed snapshot is %s", counted(s.failures, "snapshot"),
                        s.failures + s.snapshots, s.last_failed_step, s.last_error,
                        self._latest())
        self._executor.shutdown(wait=True)
        for _, handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self.staging.release()


def where_thread(prefix: str) -> str:
    """Where the first thread whose name starts with ``prefix`` is: its innermost frames."""
    frames = sys._current_frames()
    for t in threading.enumerate():
        frame = frames.get(t.ident or -1)
        if t.name.startswith(prefix) and frame is not None:
            stack = traceback.extract_stack(frame)[-4:]
            return " < ".join(f"{f.name} ({Path(f.filename).name}:{f.lineno})"
                              for f in reversed(stack))
    return "no such thread"


def _check_stored(repo: Any, cache: ChunkCache, chunks: list[ChunkRef]) -> None:
    scratch = memoryview(bytearray(max(c.nbytes for c in chunks)))
    damaged = 0
    for c in chunks:
        try:
            read_chunk(repo, c.digest, c.nbytes, scratch[:c.nbytes], c)
        except (IntegrityError, ObjectNotFound) as e:
            cache.distrust(c.digest)
            damaged += 1
            log.warning("%s; the restore took its bytes from memory, and the next snapshot that "
                        "holds them writes it again", e)
        except Exception as e:  # the store cannot be read now: the check is advice only
            log.info("could not check the store's copies of the chunks a restore took from "
                     "memory (%s)", e)
            return
    log.debug("checked %d chunks a restore took from memory in the store: %d damaged",
              len(chunks), damaged)


_live: weakref.WeakSet[Pipeline[Any]] = weakref.WeakSet()
_hooked = False


def _finish_at_exit(pipeline: Pipeline[Any]) -> None:
    """A script that ends without ``close()`` still commits the snapshot it has in flight.

    At interpreter exit, ``threading._shutdown`` runs its own exit hooks before it joins the
    threads, newest first: concurrent.futures' (registered when it was imported, before any
    pipeline existed) stops every pool from taking work, and a write still in flight, which
    hands its chunks to pools of its own, then failed ("cannot schedule new futures after
    interpreter shutdown"). This hook, registered later, runs first and waits for the writes.
    """
    global _hooked
    _live.add(pipeline)
    if _hooked:
        return
    _hooked = True
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython has had it since 3.9
        return
    with contextlib.suppress(RuntimeError):  # the interpreter is already shutting down
        register(_wait_for_writes)


def _wait_for_writes() -> None:
    for pipeline in list(_live):
        try:
            pipeline.wait()
        except Exception as e:  # the process is ending: say so, never raise from here
            log.warning("could not finish the snapshot in flight at exit: %s", e)


class LocalPipeline(Pipeline[Captured]):
    """A process that snapshots alone. A model holding DTensors (FSDP2 on a world of one) takes
    the sharded layout, written as a world of one."""

    #: the last plan of a sharded layout (its box table is then written once)
    _plans: Plans | None = None

    def capture(self, model: Any, optimizer: Any, extras: dict[str, Any]) -> Captured:
        if sharded(model):
            return capture_dist(model, optimizer, extras)
        return capture(model, optimizer, extras)

    def to_stage(self, captured: Captured) -> list[Leaf]:
        return captured.leaves  # a process alone writes every leaf

    def capture_failed(self, e: Exception) -> Captured:
        raise e  # no other rank waits in this snapshot's collectives

    def write(self, step: int, captured: Captured) -> tuple[mf.Manifest, str, int]:
        if isinstance(captured, DistCaptured):
            if self._plans is None:
                self._plans = Plans()
            return write_dist(self.coll, self.snapshot_write(step), captured, plans=self._plans)
        m, sid = write_snapshot(self.snapshot_write(step), captured)
        return m, sid, m.new_bytes

    def written(self, captured: Captured, ok: bool) -> None:
        pass  # nothing to learn from a write


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


def sharded(model: Any) -> bool:
    """Whether a model holds DTensors (FSDP2, tensor parallel): then its snapshots take the
    multi-rank layout (sharded descriptors), even on a world of one."""
    return isinstance(model, torch.nn.Module) and any(
        type(p).__name__ == "DTensor" for p in model.parameters())


def written_by_this(captured: Captured) -> dict[str, TensorDescriptor]:
    """The descriptor of each leaf this process wrote into the committed snapshot, by path
    (what its staging buffers hold, chunk by chunk, for the host-memory tier)."""
    if isinstance(captured, DistCaptured):
        return captured.written
    return {leaf.path: leaf.described for leaf in captured.leaves if leaf.described is not None}
