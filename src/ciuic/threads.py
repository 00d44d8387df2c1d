"""ciuic's background threads run at a lower CPU priority than the training thread.

While an asynchronous snapshot is written, its threads (the writer, the chunk hashers and
writers, the store's calls, the batched fsync, the compression decision, buffer allocation
ahead, uploads to a mirror) compete with training for the cores. On a machine whose cores are
busy, the kernel shares them by weight; at the same priority the training steps that overlap a
snapshot of the demo model lost 50 ms on the 2-core development VM, at nice +10 36 ms (median of
8 paired runs; docs/benchmarks.md, "Background priority"). Where cores are idle (a GPU job's
host) nothing changes.

Work the training thread waits for runs at its priority: a synchronous or emergency snapshot is
written on the calling thread, and a store's calls made from a thread at normal priority (a
restore) go to threads at normal priority (:class:`Pools`). Lowering cannot be undone without
privileges, and a new thread inherits its creator's nice value: pools whose threads could be
created by either kind of thread are therefore kept in pairs.

Linux only: there a thread is a task with its own nice value. Elsewhere ``setpriority`` would
renice the whole process, so it is not called.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ciuic import knobs

_LINUX = sys.platform.startswith("linux")
T = TypeVar("T")
R = TypeVar("R")


def lower_priority() -> None:
    """Make the calling thread :attr:`~ciuic.knobs.Knobs.background_nice` nicer than the
    process's main thread (at most 19); a thread already that nice or nicer is left as it is.
    Meant as a ``ThreadPoolExecutor`` initializer or the first call of a thread's target."""
    step = knobs.get().background_nice
    if step <= 0 or not _LINUX:
        return
    try:
        tid = threading.get_native_id()
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + step)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError:  # not permitted here (a sandbox): keep the priority
        pass


def lowered() -> bool:
    """Whether the calling thread runs nicer than the process's main thread."""
    if not _LINUX:
        return False
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) > os.getpriority(
            os.PRIO_PROCESS, os.getpid())
    except OSError:
        return False


class Pools:
    """Two thread pools of ``threads`` each: one for callers at normal priority, one (named
    ``<name>-bg``, its threads lowered) for lowered callers. :meth:`get` picks the caller's."""

    def __init__(self, threads: int, name: str) -> None:
        self._normal = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._lowered = ThreadPoolExecutor(threads, thread_name_prefix=f"{name}-bg",
                                           initializer=lower_priority)

    def get(self) -> ThreadPoolExecutor:
        return self._lowered if lowered() else self._normal

    def each(self, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
        """``fn(item)`` for every item, in parallel on the caller's pool; the results in order.
        Waits for every call before it raises the first failure, so that none is left running.
        ``fn`` must not wait for work on these pools (their threads could all be waiting)."""
        if len(items) <= 1:
            return [fn(item) for item in items]
        pool = self.get()
        futures = [pool.submit(fn, item) for item in items]
        for future in futures:
            future.exception()
        return [future.result() for future in futures]

    def shutdown(self, wait: bool = False) -> None:
        """Stop both pools: waiting for their work, or cancelling what has not started."""
        for pool in (self._normal, self._lowered):
            pool.shutdown(wait=wait, cancel_futures=not wait)
