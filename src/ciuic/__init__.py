"""ciuic: the snapshot chain for PyTorch training.

Snapshots a training job's whole state while it trains, keeps every snapshot in a verifiable,
content-addressed chain, and brings an interrupted job back exactly where it was.
"""

from __future__ import annotations

from ciuic.chain.repo import Repository
from ciuic.errors import (
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
from ciuic.format.info import SnapshotInfo
from ciuic.manager import SnapshotManager
from ciuic.state.data import ResumableSampler
from ciuic.state.holder import StateHolder
from ciuic.version import __version__

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
