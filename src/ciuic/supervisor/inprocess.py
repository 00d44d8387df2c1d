"""In-process recovery: a rank's fault costs the other ranks seconds, not their processes.

Under ``ciuic run --nproc-per-node N`` (which starts the ranks itself, in place of torchrun;
:mod:`ciuic.supervisor.launch`), the training function wrapped by :func:`recoverable` is
called again, in the same process, after a fault of any rank::

    @ciuic.recoverable
    def train() -> None:
        dist.init_process_group("gloo")          # each call: a new process group
        model = DDP(build())                     # what binds to the process group, built anew
        with SnapshotManager("proj", job="run-1", save_interval=100) as manager:
            last = manager.restore(model, optimizer, sampler=sampler)
            ...                                  # the loop, as under torchrun

    train()

What happens on a fault (docs/recovery.md):

- A rank that raises (its own error, or a collective that failed because another rank died)
  tells ``ciuic run`` through the job's control store and aborts its process groups at once
  (the ranks that wait on it in a collective then fail too, instead of waiting for the
  collective's timeout). Its :class:`~ciuic.SnapshotManager` leaves its ``with`` block without
  a collective and without the emergency snapshot (the job's ranks no longer agree), keeping
  its staging buffers in ``ciuic run``'s host memory.
- ``ciuic run`` starts a replacement for each rank that died (or hands its place to a warm
  spare), opens the next generation (a fresh rendezvous store, so nothing of the old process
  group is found again) and says why.
- Every surviving rank's wrapper calls the function again with ``MASTER_PORT`` and
  ``TORCHELASTIC_RESTART_COUNT`` of the new generation; ``init_process_group`` forms the new
  group, and ``restore()`` rolls back to the latest snapshot from host memory: the survivors'
  own buffers and the lost rank's, which ``ciuic run`` kept.

Outside ``ciuic run --nproc-per-node`` the function is simply called once.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from ciuic.errors import ConfigurationError
from ciuic.supervisor import sockets

log = logging.getLogger("ciuic")
F = TypeVar("F", bound=Callable[..., Any])

#: where the job's control store is (``host:port``), set by ``ciuic run --nproc-per-node``
ENV = "CIUIC_INPROCESS"
#: a warm spare's number: it waits (its imports done) for a lost rank's place
SPARE_ENV = "CIUIC_SPARE"
#: the control store's keys (written by ``ciuic run``, except ``fault/``)
GEN = "gen"  # the current generation's number
PORT = "port/"  # + generation: its rendezvous store's port
CAUSE = "cause/"  # + generation: why the generation before it ended
STOPPED = "stopped/"  # + generation: the last step() seen in the one before
#: + generation + "/" + rank: "ORDER TEXT", a rank's fault in that generation (set by the rank;
#: ORDER counts from 1: the first to fail is the origin, the others fail for it)
FAULT = "fault/"
FAULTS = "faults/"  # + generation: how many ranks reported a fault in it
#: + generation: a fault that recovering cannot mend (a ConfigurationError): ciuic run gives
#: up at once
FATAL = "fatal/"
DONE = "done/"  # + generation + "/" + rank: the rank's function returned in that generation
FINISHED = "finished"  # every rank's function returned in the last generation: they exit
#: + spare name: "RANK GENERATION LOCAL_RANK GROUP_RANK", the place a spare takes
ASSIGN = "spare/"
#: several nodes: what a node's ciuic run reports to the leader's (node 0), per generation:
#: how many of its ranks died, and each one's "ORDER KIND TEXT" (+ generation + "/" + rank);
#: a hang of its ranks (+ generation: the text)
DEATHS = "deaths/"
DIED = "died/"
HUNG = "hung/"
#: several nodes: + a slot (GROUP_RANK): the node rank of the node that holds its ranks (set by
#: the leader; a rank of a node cut off and replaced meanwhile sees another there, and ends)
SLOT = "nodes/slot/"
NO_NODE = "-"  # a slot's node was lost, and no node holds it yet
#: several nodes: this rank's node's node rank (``--node-rank``), set by ``ciuic run``
NODE_ENV = "CIUIC_NODE"
#: + rank: the rank's training runs in :func:`recoverable` (set by the rank); where a rank has
#: not said so, ``ciuic run`` restarts every rank on a fault (+ generation in ``FULL``)
WRAPPED = "wrapped/"
FULL = "full/"
STOP = "stop"  # ciuic run gave up or was stopped: the reason; every rank re-raises
#: how long a rank waits for the next generation before it gives up
REFORM_TIMEOUT_S = 600.0
_POLL_S = 0.02


class _Control:
    """A rank's end of the control store, for the wrapper's life."""

    def __init__(self, address: str) -> None:
        from datetime import timedelta

        from torch._C._distributed_c10d import TCPStore

        host, _, port = address.rpartition(":")
        self.store = TCPStore(host, int(port), is_master=False,
                              timeout=timedelta(seconds=REFORM_TIMEOUT_S))
        self.rank = -1
        self.gen = 0
        self.faulted: int | None = None  # the generation this rank reported a fault in
        self._watch: threading.Thread | None = None
        self._running = threading.Event()  # the function runs in generation self.gen
        #: an abort and the entry into the next generation exclude each other (an abort that
        #: ran on would cut the new generation's connections)
        self._lock = threading.Lock()
        self._address = address
        self._closing = threading.Event()  # the wrapper returns or raises: the watcher ends

    def _key(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def _wait(self, keys: list[str], timeout_s: float, store: Any = None) -> str | None:
        """The first of ``keys`` to exist, or None after ``timeout_s``."""
        store = store or self.store
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and not self._closing.is_set():
            for k in keys:
                if store.check([k]):
                    return k
            time.sleep(_POLL_S)
        return None

    def take_place(self) -> None:
        """A warm spare: import what a rank's first generation imports on first use, then
        wait until ``ciuic run`` gives it a lost rank's place."""
        spare = os.environ[SPARE_ENV]
        t0 = time.monotonic()
        warmed = warm_imports()
        log.info("ciuic: warm spare %s ready (imports done, %d more in %.2f s); waiting for a "
                 "rank's place", spare, warmed, time.monotonic() - t0)
        key = ASSIGN + spare
        if self._wait([key, STOP], float("inf")) != key:
            raise SystemExit(0)  # the job ended without needing it
        rank, gen, local, group = self.store.get(key).decode().split()
        os.environ["RANK"], os.environ["LOCAL_RANK"] = rank, local
        os.environ["GROUP_RANK"] = os.environ["ROLE_RANK"] = group
        os.environ.pop(SPARE_ENV, None)
        self.enter(int(gen))
        log.info("ciuic: warm spare %s takes rank %s in generation %s", spare, rank, gen)

    def enter(self, gen: int) -> None:
        """Set this process's environment for generation ``gen``."""
        with self._lock:
            self._enter(gen)

    def _enter(self, gen: int) -> None:
        self.gen = gen
        self.rank = int(os.environ.get("RANK", "0"))
        os.environ["MASTER_PORT"] = self.store.get(PORT + str(gen)).decode()
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(gen)
        os.environ["CIUIC_RUN_RESTART"] = str(gen)
        for key, env in ((CAUSE, "CIUIC_RUN_CAUSE"), (STOPPED, "CIUIC_RUN_STOPPED_AT")):
            if gen and self._key(key + str(gen)):
                os.environ[env] = self.store.get(key + str(gen)).decode()
            else:
                os.environ.pop(env, None)

    def running(self) -> None:
        with self._lock:
            self._running.set()
        if self._watch is None:
            self.store.set(WRAPPED + str(self.rank), str(os.getpid()))
            self._watch = threading.Thread(target=self._watcher, name="ciuic-inprocess",
                                           daemon=True)
            self._watch.start()

    def _watcher(self) -> None:
        """Abort this rank's process groups as soon as the next generation opens (another
        rank's fault) while the function still runs in this one: a rank computing, or waiting
        in a collective on a rank that is still alive, learns of it at once. (Its own
        connection to the store: the main thread's may be in a request.)"""
        from datetime import timedelta

        from torch._C._distributed_c10d import TCPStore

        host, _, port = self._address.rpartition(":")
        store = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
        while not self._closing.is_set():
            if not self._running.wait(timeout=0.5):
                continue
            gen = self.gen
            if not self._wait([f"{PORT}{gen + 1}", STOP], 3600.0, store):
                continue
            with self._lock:
                if self._running.is_set() and self.gen == gen and self.faulted != gen:
                    log.warning("ciuic: rank %d: another rank failed (generation %d ended): "
                                "aborting this rank's collectives", self.rank, gen)
                    self._running.clear()
                    abort_groups()

    def close(self) -> None:
        """End the watcher before the process exits: a daemon thread inside a store request
        (which releases the GIL) when the interpreter finalizes is ended by ``pthread_exit``,
        whose unwinding through torch's C++ frames aborts the process ("terminate called
        without an active exception", exit 134 for a rank that ended well)."""
        self._closing.set()
        self._running.clear()
        if self._watch is not None:
            self._watch.join(timeout=5.0)

    def fault(self, e: BaseException) -> None:
        """Report this rank's fault in the current generation (once) and abort its groups."""
        with self._lock:
            self._fault(e)

    def _fault(self, e: BaseException) -> None:
        self._running.clear()
        if self.faulted == self.gen:
            return
        self.faulted = self.gen
        text = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        try:
            if isinstance(e, ConfigurationError):  # bad input: recovering would meet it again
                self.store.set(FATAL + str(self.gen), f"rank {self.rank}: {text}")
            order = self.store.add(FAULTS + str(self.gen), 1)  # the first is the origin
            self.store.set(f"{FAULT}{self.gen}/{self.rank}", f"{order} {text}")
        except Exception as err:  # ciuic run is gone: the process dies with it (pdeathsig)
            log.warning("ciuic: could not report the fault to ciuic run: %s", err)
        abort_groups()

    def finished(self) -> bool:
        """The function returned: wait until every rank's did (True), or until another
        rank's fault opens the next generation (False: this rank takes part in it too, its
        function called again, restoring the last snapshot)."""
        with self._lock:
            self._running.clear()
        self.store.set(f"{DONE}{self.gen}/{self.rank}", "")
        nxt = f"{PORT}{self.gen + 1}"
        got = self._wait([FINISHED, nxt, STOP], REFORM_TIMEOUT_S)
        if got != nxt:
            return True  # (STOP: ciuic run ends the job; this rank's part is done)
        replaced = self.replaced()
        if replaced is not None:
            log.error("ciuic: rank %d: %s", self.rank, replaced)
            return True
        self.enter(int(self.store.get(GEN).decode()))
        log.warning("ciuic: rank %d had finished; another rank failed: generation %d goes "
                    "on with it", self.rank, self.gen)
        collect()
        return False

    def next_generation(self) -> bool:
        """Wait for the next generation; False where ``ciuic run`` stopped the job."""
        t0 = time.monotonic()
        nxt = f"{PORT}{self.gen + 1}"
        got = self._wait([nxt, STOP], REFORM_TIMEOUT_S)
        if got != nxt:
            why = (self.store.get(STOP).decode() if got == STOP
                   else f"no new generation within {REFORM_TIMEOUT_S:g} s")
            log.error("ciuic: rank %d stops: %s", self.rank, why)
            return False
        replaced = self.replaced()
        if replaced is not None:
            log.error("ciuic: rank %d stops: %s", self.rank, replaced)
            return False
        latest = int(self.store.get(GEN).decode())
        self.enter(latest)
        log.warning("ciuic: rank %d stayed in its process; generation %d formed %.2f s after "
                    "its fault", self.rank, latest, time.monotonic() - t0)
        return True

    def replaced(self) -> str | None:
        """Why this rank no longer belongs to the job (None: it does): on several nodes, its
        node was cut off and another node holds its ranks now."""
        node, group = os.environ.get(NODE_ENV), os.environ.get("GROUP_RANK")
        if node is None or group is None or not self._key(SLOT + group):
            return None
        holder = self.store.get(SLOT + group).decode()
        if holder == node:
            return None
        return (f"node {node} was lost to the job (cut off?) and "
                f"{'another node takes' if holder == NO_NODE else f'node {holder} holds'} its "
                "ranks now; this process ends")


#: what a rank imports on first use inside the training function, which a warm spare imports
#: ahead: measured on torch 2.13, DDP's first construction in a process imports torch._dynamo
#: (1.0 s of a 1.9 s recovery from a kill), the manager SQLAlchemy and the catalog
WARM_IMPORTS = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.fsdp",
                "torch.distributed.checkpoint.state_dict", "ciuic.manager")


def warm_imports() -> int:
    """Import :data:`WARM_IMPORTS` (those this torch has); how many were not imported yet."""
    import importlib

    fresh = 0
    for name in WARM_IMPORTS:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            fresh += 1
        except ImportError as e:  # an older torch without one of them: nothing to warm
            log.debug("ciuic: warm spare: %s not imported: %s", name, e)
    return fresh


_control: _Control | None = None
#: the TCP sockets this process listened on before the training function first ran: those
#: it listens on later are its process groups' (each gloo group listens for its peers)
_listening_before: set[int] = set()


def cut_short(wait_s: float = 0.0) -> bool:
    """Whether this rank's generation has ended under :func:`recoverable` (its own fault or
    another rank's), waiting ``wait_s`` at most for it to: what fails now, a snapshot's
    collective among it, fails for that fault, which the job recovers from. (A collective
    fails on a dead peer's socket before the next generation opens.)"""
    c = _control
    if c is None:
        return False
    end = time.monotonic() + wait_s
    while c._running.is_set() and time.monotonic() < end:
        time.sleep(_POLL_S)
    return not c._running.is_set()


def on_fault(e: BaseException) -> bool:
    """Called by a :class:`~ciuic.SnapshotManager` left by the exception ``e``: True when
    the wrapper recovers from it in this process (it was reported, the process groups are
    aborted): the manager then closes without a collective and keeps its host memory."""
    c = _control
    if c is None or isinstance(e, (KeyboardInterrupt, SystemExit)):
        return False
    c.fault(e)
    return True


#: what a fault abandons that its exception did not (a manager closed by hand, not by ``with``)
_open: weakref.WeakSet[Any] = weakref.WeakSet()


def opened(manager: Any) -> None:
    """A manager built under the wrapper registers here; a fault abandons it (its
    ``_close(final=False, abandoned=True)``) if it is still open then."""
    if _control is not None:
        _open.add(manager)


def abandon_open() -> None:
    for manager in list(_open):
        try:
            if not manager._closed:
                manager._close(final=False, abandoned=True)
        except Exception as e:  # a fault's clean-up never stops the recovery
            log.warning("could not abandon a manager after the fault: %s", e)
    _open.clear()


def collect() -> None:
    """The last generation's objects (model, optimizer, process groups: their cycles hold
    device memory the next needs) freed before the function runs again."""
    import gc

    gc.collect()
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.empty_cache()


def abort_groups() -> None:
    """Abort every process group of this process (the training's and ciuic's), and cut their
    connections: NCCL's collectives in flight here are cut short by the abort; gloo's abort
    closes nothing (measured: a peer waiting on this rank waits until this process exits),
    so this rank's end of each of its gloo connections is shut down, and every collective
    waiting on one, here or on another rank, fails at once."""
    import torch.distributed as dist

    cut = sockets.cut(_listening_before)
    if cut:
        log.debug("shut down %d connections of the process groups", cut)
    if dist.is_available() and dist.is_initialized():
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        except Exception as e:
            log.debug("could not abort the process groups (%s); destroying them", e)
            try:
                dist.destroy_process_group()
            except Exception as err:
                log.debug("could not destroy the process groups: %s", err)


def recoverable(fn: F) -> F:
    """Make ``fn`` (the training, from ``init_process_group`` to the end) recoverable in its
    process under ``ciuic run --nproc-per-node``: after a fault of any rank it is called
    again, with the same arguments, in a new generation of the job. It must build what binds
    to the process group (DDP, FSDP, device meshes, optimizers over them) inside, and restore
    from its :class:`~ciuic.SnapshotManager` at its start. Elsewhere it is called once."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _control, _listening_before
        address = os.environ.get(ENV)
        if not address:
            return fn(*args, **kwargs)
        if _control is not None:
            raise RuntimeError("a recoverable function called inside another: wrap only the "
                               "outermost training function")
        _listening_before = sockets.listening()
        _control = c = _Control(address)
        try:
            if os.environ.get(SPARE_ENV):
                c.take_place()
            else:
                c.enter(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
            hook = sys.excepthook  # init_process_group wraps it again each generation
            while True:
                sys.excepthook = hook
                c.running()
                try:
                    result = fn(*args, **kwargs)
                    if c.finished():
                        return result
                    continue  # another rank failed before every rank was done: again
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as e:
                    if c.faulted != c.gen:
                        log.warning("ciuic: rank %d failed in generation %d: %s: %s", c.rank,
                                    c.gen, type(e).__name__, str(e).splitlines()[0][:200]
                                    if str(e) else "")
                    c.fault(e)
                    abandon_open()  # managers not left through a with block
                    if not c.next_generation():
                        raise
                    del e  # its traceback holds the last generation's frames (and tensors)
                    collect()
        finally:
            c.close()
            _control = None

    return wrapper  # type: ignore[return-value]
