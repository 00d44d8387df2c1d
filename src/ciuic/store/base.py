"""The object store interface every backend implements.

A store is a flat namespace of keys ("chunks/ab/ab12...", "jobs/p/j/manifests/<id>.json") mapped
to immutable byte strings. Keys are "/"-separated; each component matches ``[A-Za-z0-9._-]+`` and
is neither "." nor "..". Backends never interpret keys beyond that.

Who calls what, and when (docs/format.md, "Write order"):
the writer ``put``s chunks and the body, then ``create``s the manifest (the commit point); readers
``get``; ``gc`` and retention ``delete`` in the reverse order.
"""

from __future__ import annotations

import abc
import builtins
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext

from ciuic.errors import InvalidKey

_COMPONENT = re.compile(r"^[A-Za-z0-9._-]+$")

Buffer = bytes | bytearray | memoryview
#: An object's bytes: one buffer, or a list of buffers written back to back (no join needed).
Data = Buffer | list[Buffer]


def parts(data: Data) -> list[memoryview]:
    """``data`` as a list of byte views."""
    if isinstance(data, list):
        return [memoryview(p).cast("B") for p in data]
    return [memoryview(data).cast("B")]


def size(data: Data) -> int:
    """How many bytes ``data`` holds."""
    return sum(len(p) for p in parts(data))


def joined(data: Data) -> bytes:
    return b"".join(parts(data)) if isinstance(data, list) else bytes(data)


#: the longest key and '/'-separated part a store accepts: every backend can hold them (a local
#: file name may have 255 bytes; S3 keys 1024)
MAX_KEY_CHARS = 1024
MAX_PART_CHARS = 200


def check_key(key: str) -> str:
    """Return ``key`` if it is well formed, else raise :class:`InvalidKey`."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"invalid store key {key!r}: must be a non-empty string")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidKey(f"invalid store key {key[:60]!r}...: longer than {MAX_KEY_CHARS} "
                         "characters")
    for part in key.split("/"):
        if len(part) > MAX_PART_CHARS:
            raise InvalidKey(f"invalid store key {key[:60]!r}...: a part is longer than "
                             f"{MAX_PART_CHARS} characters (file systems refuse such names)")
        if part in ("", ".", "..") or not _COMPONENT.match(part):
            raise InvalidKey(
                f"invalid store key {key!r}: each '/'-separated part must match "
                "[A-Za-z0-9._-]+ and must not be '.' or '..'"
            )
    return key


def check_prefix(prefix: str) -> str:
    """Validate a listing prefix: "" or a key-like string that may end with "/"."""
    if prefix:
        check_key(prefix.rstrip("/"))
    return prefix


class Store(abc.ABC):
    """A durable, flat key -> bytes namespace. Implementations must be thread-safe."""

    #: A URL that reopens this store (``open_store(store.url)``).
    url: str
    #: Typical write speed of one writer thread, in bytes/s: whether compressing a chunk pays
    #: for its CPU time (``compression="auto"``) is judged against it.
    write_bytes_per_s: float = 1e9

    def write_speed(self, measure: bool = True) -> tuple[float, float | None]:
        """(bytes/s one writer thread reaches, bytes/s all writers reach together, or None when
        writers add up, as separate connections to object storage do). Judged against by
        ``compression="auto"``; a local disk measures itself (its writers share one disk)
        unless ``measure`` is False."""
        return self.write_bytes_per_s, None

    def expect(self, prefixes: Iterable[str]) -> None:
        """Writes under ``prefixes`` (each ending with "/") will come: prepare for them now,
        off their path. A local store makes their directories; others need nothing."""
        return None

    def read_speed(self) -> float | None:
        """Bytes/s a restore reads at, all its readers together, when known (a local disk
        measures it with its write speed: :meth:`write_speed`); None where the writes' speed
        is the best guess. Judged against by ``compression="auto"``: compressed chunks must not
        make a restore wait on the decoder."""
        return None

    @abc.abstractmethod
    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        """Write ``data`` under ``key``, atomically and durably.

        Idempotent: writing the same bytes twice is harmless; an existing object is replaced
        (callers only ever re-put identical content for content-addressed keys). When this
        returns the object survives a crash; a crash during the call leaves either the old
        object, the new one, or nothing, never a partial object.

        With ``durable=False`` the write is still atomic, but it is only guaranteed to survive
        a crash after the next :meth:`sync` returns (the writer batches many chunk writes this
        way and syncs once before it writes anything that refers to them).
        """

    def put_many(self, items: Sequence[tuple[str, Data]], *, durable: bool = True) -> None:
        """:meth:`put` each ``(key, data)``, in order: a wrapper passes the whole batch on in one
        call (the writer batches small chunks so that each costs no thread hand-off of its own).
        Not atomic as a whole: a failure may leave any prefix of the batch written."""
        for key, data in items:
            self.put(key, data, durable=durable)

    def sync(self) -> None:  # noqa: B027 - stores that are always durable need nothing
        """Make every ``put(..., durable=False)`` made so far durable."""

    @abc.abstractmethod
    def create(self, key: str, data: Data) -> bool:
        """Atomically create ``key`` only if it does not exist (the commit primitive).

        Returns True if this call created it, False if it already existed (nothing is
        changed then). Durable on return, like :meth:`put`.
        """

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The bytes stored under ``key``. Raises :class:`~ciuic.errors.ObjectNotFound`."""

    def get_into(self, key: str, buffers: list[memoryview], offset: int = 0) -> int:
        """Read ``key``'s bytes from ``offset`` on into ``buffers``, back to back, and return
        the object's size in bytes.

        Bytes beyond the buffers' total are not read; a shorter object leaves the tail of the
        buffers untouched (callers compare the returned size; an ``offset`` at or past the end
        reads nothing). Raises :class:`~ciuic.errors.ObjectNotFound`. Backends override it to
        avoid a copy, and to read only the range asked for (a piece inside a larger object).
        """
        if offset < 0:
            raise ValueError(f"a read starts at an offset of 0 or more, not {offset}")
        whole = memoryview(self.get(key))
        data = whole[offset:]
        off = 0
        for buf in buffers:
            n = min(len(buf), len(data) - off)
            if n <= 0:
                break
            buf[:n] = data[off:off + n]
            off += n
        return len(whole)

    @abc.abstractmethod
    def has(self, key: str) -> bool:
        """Whether ``key`` exists. Never raises for a missing key."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]:
        """Every key that starts with ``prefix``, in sorted order. Empty if none."""

    def children(self, prefix: str) -> builtins.list[str]:
        """The names one level below ``prefix`` (which ends with "/"), sorted: each key under
        it contributes the part of its name before the next "/" (``children("projects/")`` of a
        server's storage: its projects). Backends that can list one level override this; the
        default lists every key."""
        check_prefix(prefix)
        if not prefix.endswith("/"):
            raise ValueError(f"children() takes a prefix that ends with '/', got {prefix!r}")
        return sorted({k[len(prefix):].split("/", 1)[0] for k in self.list(prefix)})

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``. Idempotent: a missing key is not an error."""

    #: whether :meth:`missing` answers many keys in one round trip (a server): the writer then
    #: asks once per snapshot instead of once per chunk
    batch_missing: bool = False

    def missing(self, keys: builtins.list[str]) -> builtins.list[str]:
        """Which of ``keys`` the store lacks, in their order."""
        return [k for k in keys if not self.has(k)]

    def lock(self, name: str) -> AbstractContextManager[None]:
        """A lock named ``name`` (a key-like string), exclusive across every process that uses
        this store, held for the ``with`` block. Used to make a fencing check and a commit
        atomic. The default is no lock at all: backends that can lock override it, and callers
        document what they lose without one."""
        check_key(name)
        return nullcontext()

    def copies(self) -> builtins.list[Store]:
        """The independent copies a read may fall back to, nearest first (a mirror has two)."""
        return [self]

    def location(self, key: str = "") -> str:
        """A human-readable location of ``key`` (for logs), e.g. a path or URL."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources. The default does nothing."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
