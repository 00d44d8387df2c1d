"""``from ciuic.data import ResumableSampler`` (it lives in :mod:`ciuic.state.data`)."""

from __future__ import annotations

from ciuic.state.data import ResumableSampler

__all__ = ["ResumableSampler"]
