"""Where the embedded store lives, and whether it can be written: what the repository and the
command line's quick reads (:mod:`ciuic.chain.listing`) both ask before they open a local
store. Imports neither SQLAlchemy nor the catalog."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = ".ciuic"


def default_location() -> str:
    """Where the embedded store lives: ``$CIUIC_HOME``, else ``./.ciuic``."""
    return os.environ.get("CIUIC_HOME") or DEFAULT_HOME


def read_only(root: Path) -> bool:
    """Whether ``root`` holds a store that cannot be written (a read-only mount, no
    permission): its ``objects/`` exists and is not writable."""
    objects = root / "objects"
    return objects.is_dir() and not os.access(objects, os.W_OK)
