"""When to compress chunks with the float codec (:mod:`ciuic.floatcodec`).

``compression`` is ``"off"``, ``"on"`` (every float chunk the codec shrinks by 5 % or more) or
``"auto"`` (the default): once per snapshot and float kind, the first MiB of the first chunk of
that kind is encoded twice and BLAKE3'ed twice, timed (on one long-lived thread while the writer
threads wait), and the kind is compressed when a model of the writing pipeline says it finishes
sooner (:func:`compression_pays`):

- ``workers`` threads hash, encode and hand bytes to the store, on at most as many cores as the
  process may use (``min(knobs.write_threads, cores)``);
- the store takes bytes at its own speed (:meth:`ciuic.store.Store.write_speed`): per writer
  for object storage (connections add up), in all for a local disk (measured once per file
  system: the writers share it).

Per raw byte, raw chunks take ``max((hash + copy) / workers, 1 / store)``; compressed ones
``ratio / store`` as long as their CPU work, ``(hash + encode + ratio * copy) / workers``, is at
most half of that (the store stays the bottleneck with room to spare: a CPU training job wants
its cores). Compression is chosen when both hold and it saves at least 10 %, and only when a
restore keeps pace (:func:`restore_pays`): reading the compressed bytes and decoding them on the
restore's cores takes at most 5 % longer than reading and hashing raw ones, at the store's read
speed (a local disk measures a cold read with its write probe; elsewhere the writes' speed stands
in). On the development VM (2 cores, a disk that reads about 1 GB/s) that says raw whatever the
writes say; on object storage, and on a 16-core GPU machine with a disk that reads 1 GB/s,
compressed; with a disk that reads 3 GB/s, raw (decoding would add 7 % to the restore).

The model starts from a probe, and a probe of a noisy disk can be wrong by 2x. So ``"auto"``
then follows what the snapshots' writes actually take (:meth:`CompressionPolicy.observe`):
the seconds per new byte from the start of the write to the commit, smoothed, for snapshots
written raw and for compressed ones. Once both are known, the cheaper wins (raw unless
compressed is at least 5 % cheaper), and compressed only while a restore keeps pace (as above;
where no read speed was measured, the raw snapshots' measured speed stands in); when only
compressed ones were measured, the next full
enough snapshot is written raw to measure it; every :data:`REVISIT` snapshots the other choice
is measured again. Each change is logged with the figures, and :attr:`CompressionPolicy.choice`
says what holds and why (``stats.compression``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ciuic import knobs
from ciuic.engine.own_thread import OwnThread
from ciuic.errors import ConfigurationError
from ciuic.format import floatcodec
from ciuic.format.digest import digest
from ciuic.threads import lower_priority

log = logging.getLogger("ciuic")

MODES = ("auto", "on", "off")
#: Pieces smaller than this are stored raw (the codec's header and zstd's set-up dominate).
MIN_PIECE_BYTES = 64 * 1024

_TORCH_KINDS: dict[torch.dtype, tuple[str, int]] = {
    torch.float32: ("f32", 4), torch.bfloat16: ("bf16", 2), torch.float16: ("f16", 2),
    torch.float64: ("f64", 8),
}
_NUMPY_KINDS: dict[str, tuple[str, int]] = {"float32": ("f32", 4), "float16": ("f16", 2),
                                            "float64": ("f64", 8)}


def float_kind(value: Any) -> tuple[str, int] | None:
    """(codec kind, itemsize) of a tensor or array of floats, else None."""
    if isinstance(value, torch.Tensor):
        return _TORCH_KINDS.get(value.dtype)
    if isinstance(value, np.ndarray):
        return _NUMPY_KINDS.get(value.dtype.name)
    return None


#: The decision encodes (twice, timed) this many leading bytes of a kind's first piece.
DECIDE_BYTES = 1024 * 1024
#: CPU time to hand one byte to the kernel (a write into the page cache: 10 GB/s on the
#: development VM; the disk's own speed is the store's write speed).
PAGE_CACHE_S_PER_BYTE = 1e-10
#: Compress only when the model says it saves at least this fraction of the writing time.
MIN_GAIN = 0.10
#: ... and only when the store stays the bottleneck with room to spare: the CPU work of a
#: compressed chunk at most this fraction of its store time. Restoring decodes on as many cores
#: (at about the encoding speed), and a CPU training job wants its cores: on the 2-core
#: development VM, where the model without this rule chose to compress, durable time did not
#: improve and the cold restore took 1.84 s instead of 0.9 (docs/benchmarks.md,
#: "compression=auto on this VM").
HEADROOM = 0.5
#: Snapshots that write fewer new bytes than this say nothing about the store's speed.
OBSERVE_MIN_BYTES = 16 * 1024 * 1024
#: Compressed must be this much cheaper than raw, per byte, to be chosen over it.
MEASURED_GAIN = 0.05
#: Measure the choice not taken again after this many observed snapshots.
REVISIT = 16
#: Weight of the newest observation in the smoothed cost.
SMOOTHING = 0.5


def compression_pays(ratio: float, encode_s: float, hash_s: float, copy_s: float, workers: int,
                     store_bps: float) -> bool:
    """Whether the pipeline writes sooner compressed (see the module docstring).

    ``ratio``: encoded / raw bytes; ``encode_s``, ``hash_s``, ``copy_s``: seconds per raw byte
    on one core; ``workers``: threads on their own cores; ``store_bps``: bytes/s the store
    takes from all of them together.
    """
    workers = max(1, workers)
    raw = max((hash_s + copy_s) / workers, 1 / store_bps)
    cpu = (hash_s + encode_s + ratio * copy_s) / workers
    io = ratio / store_bps
    return cpu <= HEADROOM * io and io < (1 - MIN_GAIN) * raw


#: A restore of compressed chunks may take at most this much longer than of raw ones (#19:
#: compression="auto" never makes the restore more than 5 % slower).
RESTORE_SLACK = 0.05


def restore_pays(ratio: float, decode_s: float, hash_s: float, cores: int,
                 read_bps: float) -> bool:
    """Whether a restore of compressed chunks is no more than :data:`RESTORE_SLACK` slower than
    of raw ones: per raw byte, raw takes ``1 / read + hash / cores``, compressed
    ``ratio / read + (hash + decode) / cores``.

    The reads and the CPU work are added, not overlapped: reading costs the cores too (the
    kernel's copy out of the page cache), and on the 2-core development VM a compressed restore
    took 1.48x the raw one (1.78 s against 1.20), where the sum predicts 1.38x and the larger
    of the two 1.0x. ``decode_s``, ``hash_s``: seconds per raw byte on one core; ``cores``: the
    cores a restore hashes and decodes on; ``read_bps``: bytes/s the store reads at, all
    readers together."""
    cores = max(1, cores)
    raw = 1 / read_bps + hash_s / cores
    packed = ratio / read_bps + (hash_s + decode_s) / cores
    return packed <= (1 + RESTORE_SLACK) * raw


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _per_byte(fn: Callable[[], object], nbytes: int) -> float:
    best = math.inf
    for _ in range(2):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9) / max(1, nbytes)


#: One long-lived thread for every decision of the process: its temporary buffers come back from
#: one malloc arena each time, where the writer threads (new each snapshot) left the RSS
#: wandering by +-8 MiB over 150 snapshots of a 12.6 MiB state (flat with compression off).
_decider = OwnThread("ciuic-decide", lower_priority)  # timed as the writer threads run


def _gib_s(per_byte: float) -> str:
    return f"{per_byte * 2**30:.2f} s/GiB"


class CompressionPolicy:
    """Decides, per snapshot and float kind, whether chunks are compressed. Thread-safe.

    Args:
        mode: ``"auto"``, ``"on"`` or ``"off"``.
        write_speed: the store's :meth:`~ciuic.store.Store.write_speed`, called at the first
            decision (a local disk measures itself once per process; the manager starts that
            in the background when it opens), or a fixed (per writer, total or None) pair.
        read_speed: the store's :meth:`~ciuic.store.Store.read_speed` (bytes/s, or None: the
            writes' speed stands in), for the restore's side of the decision.
    """

    def __init__(self, mode: str = "auto",
                 write_speed: Callable[[], tuple[float, float | None]]
                 | tuple[float, float | None] = (1e9, None),
                 read_speed: Callable[[], float | None] | None = None) -> None:
        if mode not in MODES:
            raise ConfigurationError(f"compression must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._write_speed = write_speed
        self._read_speed = read_speed
        self._speed: tuple[float, float | None] | None = None
        self._lock = threading.Lock()
        self._deciding = threading.Lock()
        self._decided: dict[str, bool] = {}
        #: the last decision per float kind and what it was based on (for logs and benchmarks)
        self.basis: dict[str, dict[str, float]] = {}
        #: measured seconds per new byte, smoothed: raw snapshots, compressed ones
        self.cost: dict[bool, float] = {}
        self._forced: bool | None = None  # what the measurements decided (None: the model)
        self._since_other = 0  # observed snapshots since the choice not taken was measured
        self._encoded_any = False  # this snapshot compressed a chunk
        #: what holds and why, in words (``stats.compression``)
        self.choice = {"auto": "auto: not decided yet", "on": "on (pinned)",
                       "off": "off (pinned)"}[mode]

    def start_snapshot(self) -> None:
        """Forget the previous snapshot's decisions (the data changes as training goes)."""
        with self._lock:
            self._decided.clear()
            self._encoded_any = False

    def observe(self, new_bytes: int, seconds: float) -> None:
        """After a snapshot's commit: its new (raw) bytes and the seconds from the start of its
        write to the commit. Updates the measured costs and, for ``"auto"``, the choice."""
        if self.mode != "auto" or new_bytes < OBSERVE_MIN_BYTES or seconds <= 0:
            return
        with self._lock:
            compressed = self._encoded_any
            per_byte = seconds / new_bytes
            old = self.cost.get(compressed)
            self.cost[compressed] = per_byte if old is None else (
                SMOOTHING * per_byte + (1 - SMOOTHING) * old)
            if self._forced is not None and compressed == self._forced:
                self._since_other += 1  # another snapshot of the choice taken
            before = self._forced
            raw, packed = self.cost.get(False), self.cost.get(True)
            if raw is not None and packed is not None:
                restores = self._restores_keep_pace(1 / raw)
                best = packed < (1 - MEASURED_GAIN) * raw and restores
                self._forced = best
                if self._since_other >= REVISIT:  # measure the other one again, once
                    self._forced, self._since_other = not best, 0
                why = f"measured {_gib_s(raw)} raw against {_gib_s(packed)} compressed"
                if not restores:
                    why += "; a restore would wait on the decoder, not the reads"
            elif packed is not None:  # only compressed was measured: measure raw next
                self._forced, why = False, f"measured {_gib_s(packed)} compressed; measuring raw"
            else:  # only raw was measured: the model may still choose compression next
                self._forced, why = None, f"measured {_gib_s(raw or per_byte)} raw"
            label = {True: "compress", False: "raw", None: "as the model says"}[self._forced]
            self.choice = f"auto: {label} ({why})"
            changed = before != self._forced and self._forced is not None
        if changed:
            log.info("compression=auto: %s chunks from the next snapshot on (%s)",
                     "compressing" if self._forced else "not compressing", why)

    def read_bps(self, written_bps: float | None = None) -> float:
        """Bytes/s a restore reads the store at: measured (a local disk), else the writes'
        speed (``written_bps``, what raw snapshots measured, or the store's own figure)."""
        read = self._read_speed() if self._read_speed is not None else None
        if read:
            return read
        return written_bps or self.store_bps()

    def _restores_keep_pace(self, written_bps: float | None = None) -> bool:
        """Whether every float kind probed so far restores compressed within
        :data:`RESTORE_SLACK` of raw (:func:`restore_pays`), from the probes' figures."""
        read = self.read_bps(written_bps)
        return all(restore_pays(b["ratio"], 1e-9 / b["decode_gbps"], 1e-9 / b["hash_gbps"],
                                usable_cores(), read)
                   for b in self.basis.values() if b.get("decode_gbps") and b.get("hash_gbps"))

    def store_bps(self) -> float:
        """Bytes/s the store takes from all writer threads together."""
        with self._lock:
            if self._speed is None:
                ws = self._write_speed
                self._speed = ws() if callable(ws) else ws
            per_writer, total = self._speed
        writers = knobs.get().write_threads * per_writer
        return writers if total is None else min(total, writers)

    def encode(self, kind: tuple[str, int] | None, piece: memoryview) -> bytes | None:
        """The codec's payload for ``piece`` (of that float kind), or None to store it raw."""
        if kind is None or self.mode == "off" or len(piece) < MIN_PIECE_BYTES:
            return None
        name, itemsize = kind
        if self.mode == "on":
            return floatcodec.encode(piece, itemsize, float_kind=name)
        with self._lock:
            decided = self._decided.get(name)
            forced = self._forced
        if forced is not None:  # what the snapshots' own writes said
            decided = forced
        if decided is None:
            # one decision at a time while the writer threads wait (idle): timings taken while
            # every writer thread competes for the cores and the GIL read several times slow
            with self._deciding:
                with self._lock:
                    decided = self._decided.get(name)
                if decided is None:
                    decided = _decider.run(self._decide, name, itemsize, piece)
                    with self._lock:
                        self._decided[name] = decided
        if not decided:
            return None
        with self._lock:
            self._encoded_any = True
        return floatcodec.encode(piece, itemsize, float_kind=name)

    def _decide(self, name: str, itemsize: int, piece: memoryview) -> bool:
        """Time the codec and BLAKE3 on the first :data:`DECIDE_BYTES` of this first piece of
        the kind, and ask the pipeline model."""
        measured = floatcodec.measure(piece, itemsize, name, nbytes=DECIDE_BYTES)
        if measured is None:  # does not compress
            with self._lock:
                self.basis[name] = {"ratio": 1.0, "compress": 0.0}
            return False
        ratio, encode_s, decode_s = measured
        head = piece[:DECIDE_BYTES]
        hash_s = _per_byte(lambda: digest(head), len(head))
        copy_s = PAGE_CACHE_S_PER_BYTE
        workers = min(knobs.get().write_threads, usable_cores())
        store = self.store_bps()
        read = self.read_bps()
        writes = compression_pays(ratio, encode_s, hash_s, copy_s, workers, store)
        restores = restore_pays(ratio, decode_s, hash_s, usable_cores(), read)
        pays = writes and restores
        basis = {"ratio": ratio, "encode_gbps": 1e-9 / encode_s,
                 "decode_gbps": 1e-9 / decode_s, "hash_gbps": 1e-9 / hash_s,
                 "workers": workers, "store_gbps": store / 1e9, "read_gbps": read / 1e9,
                 "writes_pay": float(writes), "restores_keep_pace": float(restores),
                 "compress": float(pays)}
        with self._lock:
            self.basis[name] = basis
            if not self.cost:
                self.choice = (f"auto: {'compress' if pays else 'raw'} (a probe of the store: "
                               f"writes {store / 1e9:.2f} GB/s, reads {read / 1e9:.2f} GB/s"
                               f"{'' if restores else ', a restore would wait on the decoder'}"
                               "; not measured yet)")
        log.debug("compression=auto, %s: %s", name,
                  ", ".join(f"{k} {v:.3g}" for k, v in basis.items()))
        return pays
