"""Heartbeats: each rank's ``step()`` stores its step and a monotonic time into a slot of a
memory-mapped region the supervisor shares with every rank (one store into a mapped page; no
system call). The supervisor reads the slots every 0.1 s.

A slot (128 bytes, little-endian)::

    magic   q   SLOT_MAGIC once the rank has attached
    pid     q   the rank's process
    step    q   the last step() + 1 (0: none yet)
    alive   d   CLOCK_MONOTONIC of the last step(), or of the end of a busy span
    busy    q   what the rank is doing that is not training (BUSY), 0 when training
    since   d   when that began
    commit  q   the last committed step + 1 (0: none yet)
    commits q   snapshots committed by this process
    started d   when the rank attached
    rank    q   the rank (global)
    fails   q   snapshots that failed in this process
    failed  q   the last failed step + 1 (0: none)

CLOCK_MONOTONIC is the same clock in every process of a machine, so the supervisor compares
these times with its own. A busy rank (restoring, saving synchronously, waiting for a write) is
never taken for a hung one: the timeout counts from the end of the busy span. A rank done with
training (its manager closed) stays busy "done" until it exits: its slot still says where it
stopped and what it committed, for the supervisor's last read after the exit.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

SLOT_BYTES = 128
SLOTS = 512
REGION_BYTES = SLOT_BYTES * SLOTS
SLOT_MAGIC = 0x63697569635F6231  # "ciuic_b1"
_SLOT = struct.Struct("<qqqdqdqqdqqq")
_STEP = struct.Struct("<qd")  # step + 1, alive: one store of 16 bytes at offset 16
_BUSY = struct.Struct("<qd")  # busy, since: at offset 32
_ALIVE = struct.Struct("<d")
_COMMIT = struct.Struct("<qq")  # at offset 48
_FAILED = struct.Struct("<qq")  # at offset 80
BUSY = {0: "training", 1: "restoring a snapshot", 2: "saving a snapshot",
        3: "waiting for a snapshot write", 4: "closing", 5: "taking an emergency snapshot",
        6: "opening its store", 7: "done with training"}
_KIND = {name: code for code, name in (
    (1, "restore"), (2, "save"), (3, "wait"), (4, "close"), (5, "emergency"), (6, "start"),
    (7, "done"))}


class Beacon:
    """A rank's slot, written by the training process."""

    def __init__(self, region: mmap.mmap, slot: int, rank: int, pid: int) -> None:
        if not 0 <= slot < SLOTS:
            raise ValueError(f"heartbeat slot {slot} outside 0..{SLOTS - 1}")
        self._map = region
        self._off = slot * SLOT_BYTES
        self._depth = 0
        now = time.monotonic()
        _SLOT.pack_into(region, self._off, 0, pid, 0, now, _KIND["start"], now, 0, 0, now, rank,
                        0, 0)
        struct.pack_into("<q", region, self._off, SLOT_MAGIC)  # valid from here on
        self._commits = 0
        self._failures = 0
        self._starting = True  # busy opening the store until the manager is built: started()
        self._done = False  # detach(): busy "done" for good

    def started(self) -> None:
        """The manager is built: from here on, silence counts."""
        if self._starting:
            self._starting = False
            _BUSY.pack_into(self._map, self._off + 32, 0, 0.0)
            _ALIVE.pack_into(self._map, self._off + 24, time.monotonic())

    def step(self, step: int) -> None:
        _STEP.pack_into(self._map, self._off + 16, step + 1, time.monotonic())

    @contextlib.contextmanager
    def busy(self, kind: str) -> Iterator[None]:
        """Mark the rank busy with ``kind`` (``restore``, ``save``, ``wait``, ``close``,
        ``emergency``) for the ``with`` block; nested spans keep the outer kind."""
        self._depth += 1
        if self._depth == 1:
            _BUSY.pack_into(self._map, self._off + 32, _KIND[kind], time.monotonic())
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and not self._done:
                _BUSY.pack_into(self._map, self._off + 32, 0, 0.0)
                _ALIVE.pack_into(self._map, self._off + 24, time.monotonic())

    def committed(self, step: int) -> None:
        self._commits += 1
        _COMMIT.pack_into(self._map, self._off + 48, step + 1, self._commits)

    def failed(self, step: int) -> None:
        self._failures += 1
        _FAILED.pack_into(self._map, self._off + 80, self._failures, step + 1)

    def detach(self) -> None:
        """The rank is done with training (its manager closed): the supervisor no longer
        watches it for a hang, and still reads its last step and commit."""
        self._done = True
        with contextlib.suppress(ValueError):  # the region is already unmapped
            _BUSY.pack_into(self._map, self._off + 32, _KIND["done"], time.monotonic())


@dataclass(frozen=True)
class Beat:
    """A slot as the supervisor reads it."""

    slot: int
    rank: int
    pid: int
    step: int | None
    alive: float
    busy: str | None
    busy_since: float
    committed: int | None
    commits: int
    started: float
    failures: int = 0  # snapshots that failed
    failed: int | None = None  # the last failed step

    def silent_s(self, now: float) -> float:
        """Seconds since the last sign of training (0 while busy)."""
        return 0.0 if self.busy is not None else max(0.0, now - self.alive)


def read(region: mmap.mmap | bytes) -> list[Beat]:
    """Every attached slot of the region."""
    beats = []
    for slot in range(SLOTS):
        (magic, pid, step, alive, busy, since, commit, commits, started, rank, fails,
         failed) = _SLOT.unpack_from(region, slot * SLOT_BYTES)
        if magic != SLOT_MAGIC:
            continue
        beats.append(Beat(slot, rank, pid, step - 1 if step > 0 else None, alive,
                          BUSY.get(busy, "busy") if busy else None, since,
                          commit - 1 if commit > 0 else None, commits, started, fails,
                          failed - 1 if failed > 0 else None))
    return beats
