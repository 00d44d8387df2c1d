"""The manager: :class:`SnapshotManager`, the one object a training loop talks to, and its parts
(configuration, run session, save policy, pipeline, recovery, signals). The parts never import
the facade (:mod:`~ciuic.manager.facade`).

May import: ``distributed``, ``restore``, ``chain``, ``state``, ``engine``, ``catalog``,
``format``, ``store`` and the foundation modules.
"""

from ciuic.manager.facade import SnapshotManager
from ciuic.manager.stats import ManagerStats

__all__ = ["ManagerStats", "SnapshotManager"]
