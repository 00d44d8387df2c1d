"""A store inside another: every key under a fixed prefix (the server keeps one store per
project, ``projects/<name>/``, inside its storage)."""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager

from ciuic.store.base import Data, Store, check_key, check_prefix


class PrefixStore(Store):
    """``inner``'s keys that start with ``prefix`` (which ends with "/"), seen without it."""

    def __init__(self, inner: Store, prefix: str) -> None:
        if not prefix.endswith("/"):
            raise ValueError(f"a store prefix ends with '/', got {prefix!r}")
        check_key(prefix.rstrip("/"))
        self.inner, self.prefix = inner, prefix
        self.url = f"{inner.url.rstrip('/')}/{prefix}"
        self.write_bytes_per_s = inner.write_bytes_per_s

    def write_speed(self, measure: bool = True) -> tuple[float, float | None]:
        return self.inner.write_speed(measure)

    def expect(self, prefixes: Iterable[str]) -> None:
        self.inner.expect([self.prefix + check_prefix(p) for p in prefixes])

    def _k(self, key: str) -> str:
        return self.prefix + check_key(key)

    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        self.inner.put(self._k(key), data, durable=durable)

    def put_many(self, items: Sequence[tuple[str, Data]], *, durable: bool = True) -> None:
        self.inner.put_many([(self._k(k), d) for k, d in items], durable=durable)

    def sync(self) -> None:
        self.inner.sync()

    def create(self, key: str, data: Data) -> bool:
        return self.inner.create(self._k(key), data)

    def get(self, key: str) -> bytes:
        return self.inner.get(self._k(key))

    def get_into(self, key: str, buffers: builtins.list[memoryview], offset: int = 0) -> int:
        return self.inner.get_into(self._k(key), buffers, offset)

    def has(self, key: str) -> bool:
        return self.inner.has(self._k(key))

    @property
    def batch_missing(self) -> bool:  # type: ignore[override]
        return self.inner.batch_missing

    def missing(self, keys: builtins.list[str]) -> builtins.list[str]:
        n = len(self.prefix)
        return [k[n:] for k in self.inner.missing([self._k(k) for k in keys])]

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        n = len(self.prefix)
        for key in self.inner.list(self.prefix + prefix):
            yield key[n:]

    def children(self, prefix: str) -> builtins.list[str]:
        check_prefix(prefix)
        return self.inner.children(self.prefix + prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(self._k(key))

    def lock(self, name: str) -> AbstractContextManager[None]:
        return self.inner.lock(self._k(name))
