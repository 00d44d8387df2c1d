"""Two tiers: a fast store (local disk) mirrored to a durable one (S3), in the background.

``durability`` says when a snapshot counts as committed:

``"local"``  (default) the commit is the fast tier's; objects drain to the durable tier in the
             background, in write order (a manifest goes up only after every object written
             before it), so the durable tier never holds a snapshot whose objects are missing.
             A drain failure is logged and counted, never raised; the next run's catch-up
             (:func:`ciuic.transfer.copy_job`) sends what is still missing.
``"remote"`` the commit is the durable tier's: :meth:`sync` waits until every object is up and
             :meth:`create` creates the manifest remotely, so a snapshot is only reported
             committed once it survives the loss of the machine.

Reads go to the fast tier and fall back to the durable one for missing objects; the
repository's verified reads (:meth:`ciuic.repo.Repository.read_verified`) also fall back on
damaged ones, through :meth:`copies`. Uploads re-read the object from the fast tier, so the
caller's buffers may be reused as soon as :meth:`put` returns and memory stays bounded.
"""

from __future__ import annotations

import builtins
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from ciuic.errors import ConfigurationError, ObjectNotFound, StoreError
from ciuic.store.base import Data, Store
from ciuic.threads import Pools
from ciuic.words import counted

log = logging.getLogger("ciuic")
T = TypeVar("T")

DURABILITIES = ("local", "remote")


class MirrorStore(Store):
    def __init__(self, fast: Store, remote: Store, durability: str = "local",
                 threads: int = 6) -> None:
        if durability not in DURABILITIES:
            raise ConfigurationError(
                f"durability must be 'local' or 'remote', got {durability!r}")
        self.fast = fast
        self.remote = remote
        self.durability = durability
        self.url = fast.url
        self.write_bytes_per_s = (fast if durability == "local" else remote).write_bytes_per_s
        # Fewer drain threads than a RetryingStore's 8 call threads, so that a stalled durable
        # tier never starves the calls of the write path (has, list) of a thread.
        self._pools = Pools(threads, "ciuic-mirror")  # the caller's priority
        self._lock = threading.Lock()
        self._pending: list[Future[Any]] = []
        self._remote_has: set[str] = set()
        self._errors: list[BaseException] = []  # remote mode: raised by the next flush()
        self._failed: dict[str, Any] = {}  # local mode: key -> upload to retry before a commit
        # local mode: key -> its pending remote delete. Such a key reads as deleted (the durable
        # tier may still hold it for a moment), and a new put of it uploads after the delete.
        self._deleting: dict[str, Future[Any]] = {}
        #: Background uploads that failed (``durability="local"`` only) and the last error.
        self.drain_errors = 0
        self.last_drain_error: BaseException | None = None

    def write_speed(self, measure: bool = True) -> tuple[float, float | None]:
        return (self.fast if self.durability == "local" else self.remote).write_speed(measure)

    def read_speed(self) -> float | None:
        return self.fast.read_speed()  # a restore reads the fast tier first

    def expect(self, prefixes: Iterable[str]) -> None:
        self.fast.expect(prefixes)  # the durable tier's writes are the uploads'

    # -- background uploads ------------------------------------------------------------------

    def _submit(self, fn: Any, key: str, barrier: bool = False,
                after: Future[Any] | None = None) -> Future[Any]:
        """Run ``fn(key, earlier)`` in the background; ``earlier`` is every pending upload
        (``barrier``) or the one future it must follow (``after``)."""
        with self._lock:
            pending = [f for f in self._pending if not f.done()]
            earlier = pending if barrier else [after] if after is not None else []
            future = self._pools.get().submit(self._run, fn, key, earlier)
            self._pending = [*pending, future]
        return future

    def _run(self, fn: Any, key: str, earlier: list[Future[Any]]) -> None:
        try:
            fn(key, earlier)
        except BaseException as error:
            with self._lock:  # recorded before the future completes, so flush() sees it
                if self.durability == "remote":
                    self._errors.append(error)
                else:
                    self.drain_errors += 1
                    self.last_drain_error = error
                    self._failed[key] = fn
            if self.durability == "local":
                log.warning("mirroring %s to %s failed: %s (the fast tier holds it; the next "
                            "run or `ciuic push` sends what is missing)", key, self.remote.url,
                            error)
            raise

    def _upload(self, key: str, earlier: list[Future[Any]]) -> None:
        wait(earlier)  # a delete of the same key queued before this put
        self._ensure(key, earlier, check=self.durability == "local")

    def _ensure(self, key: str, _earlier: list[Future[Any]], check: bool = True) -> None:
        """Upload ``key`` unless the durable tier has it (``check``: ask it first; local mode
        writes objects the durable tier may already hold, e.g. after the fast tier was lost)."""
        if key in self._remote_has or (check and self.remote.has(key)):
            self._remote_has.add(key)
            return
        self.remote.put(key, self.fast.get(key))
        self._remote_has.add(key)

    def _create_remote(self, key: str, earlier: list[Future[Any]]) -> None:
        wait(earlier)  # write order: everything before the manifest is up first
        with self._lock:
            retry, self._failed = self._failed, {}
        # Earlier failures are retried first, plain uploads before commits; if one fails
        # again, this commit is not mirrored either (the remote stays consistent).
        for old, fn in sorted(retry.items(), key=lambda kv: kv[1] == self._create_remote):
            if old != key:
                self._run(fn, old, [])
        self.remote.create(key, self.fast.get(key))
        self._remote_has.add(key)

    def _delete_remote(self, key: str, earlier: list[Future[Any]]) -> None:
        wait(earlier)
        self.remote.delete(key)
        self._remote_has.discard(key)

    def _forget(self, key: str, future: Future[Any]) -> None:
        """A remote delete is done: the durable tier answers for ``key`` again (a failed one
        stays pending, so this process goes on reading the key as deleted)."""
        with self._lock:
            if self._deleting.get(key) is future and future.exception() is None:
                del self._deleting[key]

    def flush(self, timeout_s: float | None = None) -> int:
        """Wait for the background uploads; return how many failed (local mode) or raise the
        first failure (remote mode)."""
        with self._lock:
            pending = list(self._pending)
        wait(pending, timeout=timeout_s)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            errors, self._errors = self._errors, []
        if errors:
            raise StoreError(f"{counted(len(errors), 'upload')} to {self.remote.url} failed; the "
                             f"first: {errors[0]}") from errors[0]
        return sum(1 for f in pending if f.done() and f.exception() is not None)

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on the mirror's threads (used for the start-up catch-up)."""
        return self._pools.get().submit(fn, *args)

    # -- Store -------------------------------------------------------------------------------

    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        self._remote_has.discard(key)
        self.fast.put(key, data, durable=durable)
        self._upload_later(key)
        if durable and self.durability == "remote":
            self.flush()

    def put_many(self, items: Sequence[tuple[str, Data]], *, durable: bool = True) -> None:
        for key, _ in items:
            self._remote_has.discard(key)
        self.fast.put_many(items, durable=durable)
        for key, _ in items:
            self._upload_later(key)
        if durable and self.durability == "remote":  # one wait for the durable tier
            self.flush()

    def _upload_later(self, key: str) -> None:
        """Queue the upload of ``key``, just written to the fast tier (after its deletion from
        the durable tier, where one is under way)."""
        with self._lock:
            deleting = self._deleting.pop(key, None)
        self._submit(self._upload, key, after=deleting)

    def sync(self) -> None:
        self.fast.sync()
        if self.durability == "remote":
            self.flush()

    def create(self, key: str, data: Data) -> bool:
        if self.durability == "local":
            created = self.fast.create(key, data)
            if created:
                self._submit(self._create_remote, key, barrier=True)
            return created
        self.flush()
        created = self.remote.create(key, data)
        if created:
            self._remote_has.add(key)
            self.fast.put(key, data)
        return created

    def get(self, key: str) -> bytes:
        try:
            return self.fast.get(key)
        except ObjectNotFound as missing:
            return self._fallback(key, missing, lambda: self.remote.get(key))

    def get_into(self, key: str, buffers: builtins.list[memoryview], offset: int = 0) -> int:
        try:
            return self.fast.get_into(key, buffers, offset)
        except ObjectNotFound as missing:
            return self._fallback(key, missing,
                                  lambda: self.remote.get_into(key, buffers, offset))

    def _fallback(self, key: str, missing: ObjectNotFound, read: Callable[[], T]) -> T:
        """Read from the durable tier what the fast one lacks; in local mode an unreachable
        durable tier counts as not having it either, and neither does a key being deleted."""
        if key in self._deleting:
            raise missing
        try:
            return read()
        except ObjectNotFound:
            raise
        except StoreError:
            if self.durability == "remote":
                raise
            raise missing from None

    def has(self, key: str) -> bool:
        if self.durability == "remote":
            if key in self._remote_has or self.remote.has(key):
                self._remote_has.add(key)
                return True
            return False
        if self.fast.has(key):
            # The writer will skip this object: make sure the durable tier gets it too.
            self._submit(self._ensure, key)
            return True
        if key in self._deleting:
            return False
        try:
            return self.remote.has(key)
        except StoreError:
            return False  # as if missing: the caller writes it (locally, then mirrored)

    def list(self, prefix: str = "") -> Iterator[str]:
        """Remote mode: both tiers. Local mode: the fast tier, which is the authority; the
        durable tier only when the fast one has nothing there (a new or wiped machine)."""
        keys = set(self.fast.list(prefix))
        if keys and self.durability == "local":
            return iter(sorted(keys))
        try:
            keys |= set(self.remote.list(prefix))
        except StoreError as e:
            if self.durability == "remote":
                raise
            log.warning("cannot list %s (%s); using the fast tier alone", self.remote.url, e)
        return iter(sorted(keys - self._deleting.keys()))

    def delete(self, key: str) -> None:
        self._remote_has.discard(key)
        self.fast.delete(key)
        if self.durability == "local":  # in order, after any upload of the same key
            future = self._submit(self._delete_remote, key, barrier=True)
            with self._lock:
                self._deleting[key] = future
            future.add_done_callback(lambda done: self._forget(key, done))
        else:
            self.remote.delete(key)

    def lock(self, name: str) -> AbstractContextManager[None]:
        return (self.fast if self.durability == "local" else self.remote).lock(name)

    def copies(self) -> builtins.list[Store]:
        return [self.fast, self.remote]

    def location(self, key: str = "") -> str:
        return self.fast.location(key)

    def close(self) -> None:
        failed = self.flush()
        if failed:
            log.warning("%s %s not mirrored to %s; `ciuic push` sends them",
                        counted(failed, "object"), "was" if failed == 1 else "were",
                        self.remote.url)
        self._pools.shutdown(wait=True)
        self.fast.close()
        self.remote.close()
