"""ciuic: the snapshot chain for PyTorch training.

Snapshots a training job's whole state while it trains, keeps every snapshot in a verifiable,
content-addressed chain, and brings an interrupted job back exactly where it was.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
from ciuic.format.adapters import register_adapter
from ciuic.version import __version__

if TYPE_CHECKING:
    from ciuic.chain.health import HealthPolicy
    from ciuic.chain.repo import Repository
    from ciuic.format.info import SnapshotInfo
    from ciuic.manager import SnapshotManager
    from ciuic.manager.interval import AutoInterval
    from ciuic.state.data import ResumableSampler
    from ciuic.state.holder import StateHolder
    from ciuic.supervisor.inprocess import recoverable

#: imported on first use, so that ``import ciuic`` (and the command line, whose commands mostly
#: need no torch) does not import torch until a name that needs it is used
_LAZY = {
    "AutoInterval": "ciuic.manager.interval",
    "HealthPolicy": "ciuic.chain.health",
    "Repository": "ciuic.chain.repo",
    "SnapshotInfo": "ciuic.format.info",
    "SnapshotManager": "ciuic.manager",
    "ResumableSampler": "ciuic.state.data",
    "StateHolder": "ciuic.state.holder",
    "recoverable": "ciuic.supervisor.inprocess",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ciuic' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AmbiguousReference",
    "AutoInterval",
    "CaptureError",
    "CiuicError",
    "ConfigurationError",
    "CorruptObject",
    "HealthPolicy",
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
    "recoverable",
    "register_adapter",
]
