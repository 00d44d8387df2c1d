"""A long-lived worker thread of ciuic's own, created on first use, that runs calls and waits."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class OwnThread:
    """Runs calls on one thread named ``name``, made at the first call and kept (running
    ``initializer`` first).

    A call made from that thread itself (a finalizer it triggered, say) runs directly; after the
    interpreter began shutting down (no new work for the pool) calls run on the caller's thread.
    In a forked child the thread is made anew (the child has none of its parent's threads).
    """

    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self.name = name
        self._initializer = initializer
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        _instances.add(self)

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()  # it may have been held by a parent's thread

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        if threading.current_thread().name.startswith(self.name):
            return fn(*args)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix=self.name,
                                                initializer=self._initializer)
            pool = self._pool
        try:
            future = pool.submit(fn, *args)
        except RuntimeError:  # the interpreter is shutting down
            return fn(*args)
        return future.result()


_instances: weakref.WeakSet[OwnThread] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for own in list(_instances):
        own._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
