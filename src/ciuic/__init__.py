"""ciuic: the snapshot chain for PyTorch training.

Snapshots a training job's whole state while it trains, keeps every snapshot in a verifiable,
content-addressed chain, and brings an interrupted job back exactly where it was.
"""

from __future__ import annotations

from .data import ResumableSampler
from .errors import (
    AmbiguousReference,
    CaptureError,
    CiuicError,
    ConfigurationError,
    CorruptObject,
    IntegrityError,
    InvalidKey,
    ObjectNotFound,
    RestoreError,
    SnapshotNotFound,
    StateMismatch,
    StoreError,
)
from .holder import StateHolder
from .info import SnapshotInfo
from .repo import Repository
from .snapshot import SnapshotManager

__version__ = "0.1.0"

__all__ = [
    "AmbiguousReference",
    "CaptureError",
    "CiuicError",
    "ConfigurationError",
    "CorruptObject",
    "IntegrityError",
    "InvalidKey",
    "ObjectNotFound",
    "Repository",
    "RestoreError",
    "ResumableSampler",
    "SnapshotInfo",
    "SnapshotManager",
    "SnapshotNotFound",
    "StateHolder",
    "StateMismatch",
    "StoreError",
    "__version__",
]
