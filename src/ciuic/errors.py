"""Every exception class ciuic defines, in one place (other modules re-export their own).

Hierarchy::

    CiuicError (Exception)
    ├── ConfigurationError (CiuicError, ValueError)   bad arguments, names, URLs, environment
    ├── CaptureError (CiuicError, TypeError)          a state object holds something we cannot store
    ├── StoreError (CiuicError, OSError)              the object store failed
    │   ├── ObjectNotFound (StoreError, KeyError)     a key that is not in the store
    │   ├── InvalidKey (StoreError, ValueError)       a malformed or unsafe key (path traversal...)
    │   ├── StoreAccessError (StoreError)             refused or nonexistent (bucket, credentials)
    │   │   └── ReadOnlyStore (StoreAccessError)      a store on a read-only file system
    │   ├── StoreTimeout (StoreError)                 a store call did not finish in time
    │   └── DiskFull (StoreError)                     the store has no space left
    ├── IntegrityError (CiuicError)                   stored bytes cannot be used as they are
    │   └── UnreadableObject (IntegrityError)         one named object (``key``, ``reason``):
    │       ├── CorruptObject                         damaged: truncated, flipped bits, missing
    │       ├── UnsupportedFormat                     written by a newer ciuic (may be intact)
    │       └── MissingKey                            sealed with a key not configured (may be
    │                                                 intact; ``key_id`` names the key)
    ├── SnapshotNotFound (CiuicError, LookupError)    a snapshot reference that resolves to nothing
    │   └── AmbiguousReference (SnapshotNotFound)     a prefix that matches several snapshots
    ├── StateMismatch (CiuicError, ValueError)        a snapshot does not fit the live objects
    ├── RestoreError (CiuicError, RuntimeError)       snapshots exist but none could be restored
    ├── RankError (CiuicError, RuntimeError)          another rank failed; raised on every rank
    ├── FencedOut (CiuicError, RuntimeError)          another process took the job over
    ├── StagingBudgetExceeded (CiuicError, MemoryError)  the state is over the staging budget
    ├── PeerError (CiuicError)                        another node's ciuic run refused a request
    │   └── BadRequest (PeerError, ValueError)        a peer request that is not well-formed
    ├── ProtocolError (CiuicError, ValueError)        a local-channel message off its protocol
    └── ApiError (CiuicError)                         a server request refused (HTTP status, code)

Code decides by type, never by an error's text: a reader that meets an object it cannot use
tells damage (:class:`CorruptObject`: rewrite it, fall back to an older snapshot) from an object
that may be intact but is not for this process (:class:`UnsupportedFormat`: upgrade ciuic;
:class:`MissingKey`: configure the key). Messages say what is wrong and what to do next.
"""

from __future__ import annotations

from ciuic.words import counted


class CiuicError(Exception):
    """Root of every error ciuic raises."""


class ConfigurationError(CiuicError, ValueError):
    """An argument, a name, a URL or an environment variable is not usable."""


class CaptureError(CiuicError, TypeError):
    """The state cannot be captured for a snapshot, and so would fail every snapshot: a value
    that cannot be stored without pickle, or a ``state_dict()`` (or state-dict hook) that
    raised (the original exception is the cause)."""


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


class ReadOnlyStore(StoreAccessError):
    """The store's file system is read-only (EROFS): nothing in it can be changed until it is
    mounted read-write again."""


class StoreTimeout(StoreError):
    """A store call did not finish within its timeout."""


class DiskFull(StoreError):
    """The store has no space left."""


class IntegrityError(CiuicError):
    """Stored bytes do not match their name, digest or format."""


class UnreadableObject(IntegrityError):
    """One stored object cannot be used; ``key`` names it so that ``ciuic verify`` and the logs
    can point at it, ``reason`` says why. Catch this for "any problem with this object"; its
    subclasses tell damage from an object that is not for this process."""

    def __init__(self, key: str, reason: str, message: str | None = None) -> None:
        super().__init__(message or f"object {key} is damaged: {reason}")
        self.key = key
        self.reason = reason


class CorruptObject(UnreadableObject):
    """One stored object is damaged (truncated, flipped bits, wrong format) or missing."""


class UnsupportedFormat(UnreadableObject):
    """An object was written in a format this ciuic does not read (a newer frame, codec,
    cipher or body format): it may be intact; a newer ciuic reads it."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key, reason, f"object {key} cannot be read by this ciuic: {reason}")


class MissingKey(UnreadableObject):
    """An object is sealed with a key that is not configured (it may be intact)."""

    def __init__(self, key: str, key_id: str, configured: str) -> None:
        super().__init__(
            key, f"sealed with key {key_id}, which is not configured",
            f"{key} is sealed with key {key_id}, which is not configured (configured: "
            f"{configured}); set CIUIC_ENCRYPTION_KEY_FILE (or CIUIC_ENCRYPTION_KEY) to it, "
            "or add it to CIUIC_DECRYPTION_KEYS")
        self.key_id = key_id


class SnapshotNotFound(CiuicError, LookupError):
    """A snapshot reference (ID, prefix, JOB@STEP, JOB@latest) resolves to nothing."""


class AmbiguousReference(SnapshotNotFound):
    """A reference matches more than one snapshot."""


class StateMismatch(CiuicError, ValueError):
    """A snapshot does not fit the objects it is being loaded into (keys, shapes, dtypes)."""


class RestoreError(CiuicError, RuntimeError):
    """Snapshots exist for the job but none of them could be restored."""


class RankError(CiuicError, RuntimeError):
    """One or more ranks failed inside a collective step; raised on every rank, naming each
    failed rank and its error. ``failures`` maps rank -> message."""

    def __init__(self, what: str, failures: dict[int, str]) -> None:
        lines = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(failures.items()))
        super().__init__(f"{what} failed on {counted(len(failures), 'rank')}: {lines}")
        self.failures = failures


class FencedOut(CiuicError, RuntimeError):
    """Another process took over the job; this one may no longer commit snapshots."""


class StagingBudgetExceeded(CiuicError, MemoryError):
    """The state does not fit in the staging budget; the snapshot is written synchronously."""


class PeerError(CiuicError):
    """Another node's ``ciuic run`` refused a request (a wrong token, a chunk it no longer
    holds, a damaged one) or broke the protocol between nodes."""


class BadRequest(PeerError, ValueError):
    """A request between nodes that is not well-formed (answered, not served)."""


class ProtocolError(CiuicError, ValueError):
    """A message on the local channel between ``ciuic run`` and its workers that does not
    follow its protocol (refused, and the connection told why)."""


class ApiError(CiuicError):
    """A server request is refused: ``status`` (HTTP), ``code`` (machine-readable), ``message``
    (what to do). The server answers it as ``{"error": {"code", "message"}}``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


__all__ = [
    "AmbiguousReference",
    "ApiError",
    "BadRequest",
    "CaptureError",
    "CiuicError",
    "ConfigurationError",
    "CorruptObject",
    "DiskFull",
    "FencedOut",
    "IntegrityError",
    "InvalidKey",
    "MissingKey",
    "ObjectNotFound",
    "PeerError",
    "ProtocolError",
    "RankError",
    "ReadOnlyStore",
    "RestoreError",
    "SnapshotNotFound",
    "StagingBudgetExceeded",
    "StateMismatch",
    "StoreAccessError",
    "StoreError",
    "StoreTimeout",
    "UnreadableObject",
    "UnsupportedFormat",
]
