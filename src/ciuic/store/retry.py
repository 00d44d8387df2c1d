"""``RetryingStore``: bounded retries with backoff, and a timeout on every call.

Wraps any store. Transient failures (I/O errors, timeouts) are retried ``attempts`` times with
exponential backoff; permanent ones are raised at once: a missing object, an invalid key, a
full disk (ENOSPC, EDQUOT) and a read-only file system (EROFS), each saying so and what to do.
Each call runs in a helper thread so that a store that hangs (a stuck network mount, a server
that never answers) costs at most ``timeout_s`` per attempt; a call that timed out is
abandoned, not killed (Python cannot kill a thread), and its thread is left to finish or hang
on its own.
"""

from __future__ import annotations

import builtins
import errno
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from typing import TypeVar

from ciuic import knobs
from ciuic.errors import (
    DiskFull,
    InvalidKey,
    ObjectNotFound,
    ReadOnlyStore,
    StoreAccessError,
    StoreError,
    StoreTimeout,
)
from ciuic.store.base import Data, Store
from ciuic.threads import Pools
from ciuic.words import counted

T = TypeVar("T")
_FULL = (errno.ENOSPC, errno.EDQUOT)


class RetryingStore(Store):
    def __init__(self, inner: Store, attempts: int | None = None, timeout_s: float | None = None,
                 backoff_s: float | None = None) -> None:
        k = knobs.get()
        self.inner = inner
        self.attempts = attempts if attempts is not None else k.store_attempts
        self.timeout_s = timeout_s if timeout_s is not None else k.store_timeout_s
        self.backoff_s = backoff_s if backoff_s is not None else k.store_backoff_s
        self.url = inner.url
        self.write_bytes_per_s = inner.write_bytes_per_s
        # an asynchronous snapshot's calls run on lowered threads, a restore's at normal priority
        self._pools = Pools(8, "ciuic-store")

    def write_speed(self, measure: bool = True) -> tuple[float, float | None]:
        return self.inner.write_speed(measure)

    def read_speed(self) -> float | None:
        return self.inner.read_speed()

    def expect(self, prefixes: Iterable[str]) -> None:
        self.inner.expect(prefixes)

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(1, self.attempts + 1):
            future = self._pools.get().submit(fn)
            try:
                return future.result(timeout=self.timeout_s)
            except FutureTimeout:
                error: Exception = StoreTimeout(
                    f"{what} {self.inner.location(key)} did not finish in {self.timeout_s:g} s "
                    f"(attempt {attempt} of {self.attempts}); is the store reachable?")
            except (ObjectNotFound, InvalidKey, StoreAccessError):
                raise
            except OSError as e:
                cause = e.__cause__ if isinstance(e.__cause__, OSError) else e
                if cause.errno in _FULL:
                    raise DiskFull(
                        f"{what} {self.inner.location(key)} failed: no space left on the store's "
                        "device. Free space, lower keep_last, or run `ciuic prune` and "
                        "`ciuic gc`") from e
                if cause.errno == errno.EROFS:  # retrying cannot help: say so once, briefly
                    raise ReadOnlyStore(
                        f"{what} {key} failed: the store {self.inner.location()} is on a "
                        "read-only file system; remount it read-write to change it") from e
                error = e
            if attempt < self.attempts:
                time.sleep(delay)
                delay *= 2
        raise StoreError(f"{what} {self.inner.location(key)} failed after "
                         f"{counted(self.attempts, 'attempt')}: {error}") from error

    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        self._call("writing", key, lambda: self.inner.put(key, data, durable=durable))

    def put_many(self, items: Sequence[tuple[str, Data]], *, durable: bool = True) -> None:
        # one call, retried whole (a put is idempotent)
        if items:
            self._call(f"writing {len(items)} objects, the first", items[0][0],
                       lambda: self.inner.put_many(items, durable=durable))

    def sync(self) -> None:
        self._call("syncing", "", self.inner.sync)

    def create(self, key: str, data: Data) -> bool:
        # Not blindly retried: a create that succeeded but timed out would report "exists".
        return self._call("creating", key, lambda: self.inner.create(key, data))

    def get(self, key: str) -> bytes:
        return self._call("reading", key, lambda: self.inner.get(key))

    def get_into(self, key: str, buffers: list[memoryview], offset: int = 0) -> int:
        return self._call("reading", key, lambda: self.inner.get_into(key, buffers, offset))

    def has(self, key: str) -> bool:
        return self._call("checking", key, lambda: self.inner.has(key))

    @property
    def batch_missing(self) -> bool:  # type: ignore[override]
        return self.inner.batch_missing

    def missing(self, keys: list[str]) -> list[str]:
        return self._call("checking", f"{len(keys)} keys", lambda: self.inner.missing(keys))

    def list(self, prefix: str = "") -> Iterator[str]:
        return iter(self._call("listing", prefix, lambda: list(self.inner.list(prefix))))

    def children(self, prefix: str) -> builtins.list[str]:
        return self._call("listing", prefix, lambda: self.inner.children(prefix))

    def delete(self, key: str) -> None:
        self._call("deleting", key, lambda: self.inner.delete(key))

    def lock(self, name: str) -> AbstractContextManager[None]:
        return self.inner.lock(name)

    def location(self, key: str = "") -> str:
        return self.inner.location(key)

    def close(self) -> None:
        self._pools.shutdown()
        self.inner.close()
