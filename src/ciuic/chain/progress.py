"""Where a run stopped (its last ``step()``), kept where a SIGKILL cannot lose it, and how it
ended when its catalog could not record that.

The catalog's record of progress (the heartbeat) is written now and then, because a database
write every step would cost the training loop; so after a kill it can be behind by up to the
heartbeat interval. Each step() therefore also writes its step into a memory-mapped file in the
user's cache (``$XDG_CACHE_HOME/ciuic/progress/<run>``): one store into a mapped page, which the
kernel keeps when the process dies (it is lost only with the machine). The next run of the job
on the same machine takes it (:func:`take`: it says where the previous run really stopped,
records that in the catalog and removes the file); ``ciuic log`` reads it where it is
(:func:`peek`). A run that ends cleanly removes its own, unless the catalog could not record
the end (its disk is full): the end is then written into the file, whose page was allocated at
the start, for the next run to record.

The file (64 bytes, little-endian; files of 16 bytes, from before the end was kept, hold the
first two fields)::

    step   q    the last step() + 1 (0: none yet)
    time   d    the Unix time of that step()
    ended  d    the Unix time of the end the catalog could not record (0: none)
    end    40s  that end's kind (``clean``, ``signal:SIGTERM`` ...), UTF-8, NUL-padded

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
_FORMAT = struct.Struct("<qd")  # at 0: the step + 1 (0: none yet), the time it was recorded
_END = struct.Struct("<d40s")  # at 16: the end the catalog could not record, and its time
_SIZE = _FORMAT.size + _END.size
_STALE_S = 30 * 86400  # files of runs nobody resumed are removed after 30 days


def folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ciuic" / "progress"


@dataclass(frozen=True)
class Stop:
    """What a run's progress file says: the run's last step() (None: it made none), and how
    it ended, when its catalog could not record that (``end``, at the Unix time ``ended``)."""

    step: int | None
    end: str | None = None
    ended: float | None = None


class Progress:
    """This run's file: :meth:`set` is the per-step write."""

    def __init__(self, run_id: str) -> None:
        self.path = folder() / run_id
        self._map: mmap.mmap | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("wb") as f:
                f.write(bytes(_SIZE))  # every page it needs, allocated now
            with self.path.open("r+b") as f:
                self._map = mmap.mmap(f.fileno(), _SIZE)
        except OSError as e:  # a read-only home: the heartbeat alone records progress
            log.debug("progress is recorded by the heartbeat only (%s: %s)", self.path, e)

    def set(self, step: int) -> None:
        if self._map is not None:
            _FORMAT.pack_into(self._map, 0, step + 1, time.time())

    def ended(self, kind: str) -> Path | None:
        """Keep how the run ended, which the catalog could not record, for the next run;
        the file, or None when there is none."""
        if self._map is None:
            return None
        _END.pack_into(self._map, _FORMAT.size, time.time(), kind.encode()[:_END.size - 8])
        return self.path

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
    step = n - 1 if n > 0 else None
    if len(data) < _SIZE:
        return Stop(step)
    ended, kind = _END.unpack_from(data, _FORMAT.size)
    end = kind.rstrip(b"\0").decode(errors="replace")
    return Stop(step, end, ended) if end else Stop(step)


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
