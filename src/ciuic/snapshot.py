"""``from ciuic.snapshot import SnapshotManager``: the seed's import path (the manager lives in
:mod:`ciuic.manager`)."""

from __future__ import annotations

from ciuic.manager import ManagerStats, SnapshotManager

__all__ = ["ManagerStats", "SnapshotManager"]
