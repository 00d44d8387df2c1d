"""Where a run stopped (its last ``step()``), kept where a SIGKILL cannot lose it.

The catalog's record of progress (the heartbeat) is written now and then, because a database
write every step would cost the training loop; so after a kill it can be behind by up to the
heartbeat interval. Each step() therefore also writes its step into a 16-byte memory-mapped file
in the user's cache (``$XDG_CACHE_HOME/ciuic/progress/<run>``): one store into a mapped page,
which the kernel keeps when the process dies (it is lost only with the machine). The next run
of the job on the same machine takes it (:func:`take`: it says where the previous run really
stopped, records that in the catalog and removes the file); ``ciuic log`` reads it where it is
(:func:`peek`). A run that ends cleanly removes its own.

Imports no SQLAlchemy and no torch: ``ciuic log`` reads these files.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ciuic")
_FORMAT = struct.Struct("<qd")  # the step + 1 (0: none yet), and the wall time it was recorded
_STALE_S = 30 * 86400  # files of runs nobody resumed are removed after 30 days


def folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ciuic" / "progress"


@dataclass(frozen=True)
class Stop:
    """What a run's progress file says: the run's last step() (None: it made none)."""

    step: int | None


class Progress:
    """This run's file: :meth:`set` is the per-step write."""

    def __init__(self, run_id: str) -> None:
        self.path = folder() / run_id
        self._map: mmap.mmap | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("wb") as f:
                f.write(bytes(_FORMAT.size))
            with self.path.open("r+b") as f:
                self._map = mmap.mmap(f.fileno(), _FORMAT.size)
        except OSError as e:  # a read-only home: the heartbeat alone records progress
            log.debug("progress is recorded by the heartbeat only (%s: %s)", self.path, e)

    def set(self, step: int) -> None:
        if self._map is not None:
            _FORMAT.pack_into(self._map, 0, step + 1, time.time())

    def close(self, remove: bool) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if remove:
            self.path.unlink(missing_ok=True)


def peek(run_id: str) -> Stop | None:
    """What the progress file of a run of this machine says, leaving it; None if there is none
    (the run ended cleanly, ran elsewhere, or the next run took it)."""
    try:
        data = (folder() / run_id).read_bytes()
    except OSError:
        return None
    if len(data) < _FORMAT.size:
        return None
    n, _ = _FORMAT.unpack_from(data)
    return Stop(n - 1 if n > 0 else None)


def take(run_id: str) -> Stop | None:
    """:func:`peek`, and remove the file. Also removes the files of runs nobody resumed for a
    month."""
    stop = peek(run_id)
    try:
        (folder() / run_id).unlink(missing_ok=True)
        cutoff = time.time() - _STALE_S
        for old in folder().iterdir():
            if old.stat().st_mtime < cutoff:
                old.unlink(missing_ok=True)
    except OSError:
        pass
    return stop
