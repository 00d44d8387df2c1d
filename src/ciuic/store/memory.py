"""An in-memory store: fast, for tests and for throw-away runs. Not durable.

``memory://NAME`` URLs name a process-wide store, so reopening the URL in the same process sees
the same objects.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ciuic.errors import ObjectNotFound
from ciuic.store.base import Data, Store, check_key, check_prefix, joined

_NAMED: dict[str, MemoryStore] = {}
_NAMED_LOCK = threading.Lock()


class MemoryStore(Store):
    write_bytes_per_s = 1e11  # a memcpy: compression never pays
    def __init__(self, name: str = "") -> None:
        self.name = name
        self.url = f"memory://{name}"
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._named_locks: dict[str, threading.Lock] = {}

    @classmethod
    def named(cls, name: str) -> MemoryStore:
        """The process-wide store called ``name`` (created on first use)."""
        with _NAMED_LOCK:
            if name not in _NAMED:
                _NAMED[name] = cls(name)
            return _NAMED[name]

    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        check_key(key)
        blob = joined(data)
        with self._lock:
            self._objects[key] = blob

    def create(self, key: str, data: Data) -> bool:
        check_key(key)
        blob = joined(data)
        with self._lock:
            if key in self._objects:
                return False
            self._objects[key] = blob
            return True

    def get(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            try:
                return self._objects[key]
            except KeyError:
                raise ObjectNotFound(f"{self.location(key)} does not exist") from None

    def has(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._objects

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix))
        return iter(keys)

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._objects.pop(key, None)

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """A process-wide lock (the store itself lives in one process)."""
        check_key(name)
        with self._lock:
            named = self._named_locks.setdefault(name, threading.Lock())
        with named:
            yield
