"""Every error ciuic raises, in one place.

Hierarchy::

    CiuicError (Exception)
    ├── ConfigurationError (CiuicError, ValueError)   bad arguments, names, URLs, environment
    ├── CaptureError (CiuicError, TypeError)          a state object holds something we cannot store
    ├── StoreError (CiuicError, OSError)              the object store failed
    │   ├── ObjectNotFound (StoreError, KeyError)     a key that is not in the store
    │   ├── InvalidKey (StoreError, ValueError)       a malformed or unsafe key (path traversal...)
    │   └── StoreAccessError (StoreError)             refused or nonexistent (bucket, credentials)
    ├── IntegrityError (CiuicError)                   stored bytes do not match their digest/format
    │   └── CorruptObject (IntegrityError)            one object is damaged; names it
    ├── SnapshotNotFound (CiuicError, LookupError)    a snapshot reference that resolves to nothing
    │   └── AmbiguousReference (SnapshotNotFound)     a prefix that matches several snapshots
    ├── StateMismatch (CiuicError, ValueError)        a snapshot does not fit the live objects
    ├── RestoreError (CiuicError, RuntimeError)       snapshots exist but none could be restored
    └── RankError (CiuicError, RuntimeError)          another rank failed; raised on every rank

Messages say what is wrong and what to do next.
"""

from __future__ import annotations


class CiuicError(Exception):
    """Root of every error ciuic raises."""


class ConfigurationError(CiuicError, ValueError):
    """An argument, a name, a URL or an environment variable is not usable."""


class CaptureError(CiuicError, TypeError):
    """A state object contains a value that cannot be stored without pickle."""


class StoreError(CiuicError, OSError):
    """The object store failed to read, write, list or delete."""


class ObjectNotFound(StoreError, KeyError):
    """The requested key is not in the store."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "object not found"


class InvalidKey(StoreError, ValueError):
    """A key is malformed or tries to leave the store (``..``, absolute paths...)."""


class StoreAccessError(StoreError):
    """The store refuses access or does not exist (no bucket, bad credentials): retrying does
    not help, so it is raised at once."""


class IntegrityError(CiuicError):
    """Stored bytes do not match their name, digest or format."""


class CorruptObject(IntegrityError):
    """One stored object is damaged (truncated, flipped bits, wrong format).

    ``key`` names the object so that ``ciuic verify`` and the logs can point at it.
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"object {key} is damaged: {reason}")
        self.key = key
        self.reason = reason


class SnapshotNotFound(CiuicError, LookupError):
    """A snapshot reference (ID, prefix, JOB@STEP, JOB@latest) resolves to nothing."""


class AmbiguousReference(SnapshotNotFound):
    """A reference matches more than one snapshot."""


class StateMismatch(CiuicError, ValueError):
    """A snapshot does not fit the objects it is being loaded into (keys, shapes, dtypes)."""


class RestoreError(CiuicError, RuntimeError):
    """Snapshots exist for the job but none of them could be restored."""


__all__ = [
    "AmbiguousReference",
    "CaptureError",
    "CiuicError",
    "ConfigurationError",
    "CorruptObject",
    "IntegrityError",
    "InvalidKey",
    "ObjectNotFound",
    "RestoreError",
    "SnapshotNotFound",
    "StateMismatch",
    "StoreError",
]


class RankError(CiuicError, RuntimeError):
    """One or more ranks failed inside a collective step; raised on every rank, naming each
    failed rank and its error. ``failures`` maps rank -> message."""

    def __init__(self, what: str, failures: dict[int, str]) -> None:
        lines = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
        super().__init__(f"{what} failed on {len(failures)} rank(s): {lines}")
        self.failures = failures
