"""The snapshot engine: staging into reused host buffers, then writing in the background."""

from __future__ import annotations

from .staging import StagingArea, StagingBudgetExceeded

__all__ = ["StagingArea", "StagingBudgetExceeded"]
