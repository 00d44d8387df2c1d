"""The snapshot engine: staging into reused host buffers, then writing in the background.

May import: ``format`` and the foundation modules.
"""

from __future__ import annotations

from ciuic.engine.staging import StagingArea
from ciuic.errors import StagingBudgetExceeded

__all__ = ["StagingArea", "StagingBudgetExceeded"]
