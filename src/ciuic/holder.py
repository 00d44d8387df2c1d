"""``from ciuic.holder import StateHolder`` (it lives in :mod:`ciuic.state.holder`)."""

from __future__ import annotations

from ciuic.state.holder import StateHolder

__all__ = ["StateHolder"]
