"""When to compress chunks with the float codec (:mod:`ciuic.floatcodec`).

``compression`` is ``"off"``, ``"on"`` (every float chunk the codec shrinks by 5 % or more) or
``"auto"`` (the default): once per snapshot and float kind, the first chunk of that kind is
sampled with :func:`ciuic.floatcodec.should_compress` against the store's write speed per writer
thread (:attr:`ciuic.store.Store.write_bytes_per_s`), and the kind is compressed only if the
write time saved exceeds the time spent compressing. On a fast local disk that usually says no;
on object storage it says yes.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from .. import floatcodec
from ..errors import ConfigurationError

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


class CompressionPolicy:
    """Decides, per snapshot and float kind, whether chunks are compressed. Thread-safe."""

    def __init__(self, mode: str = "auto", write_bytes_per_s: float = 1e9) -> None:
        if mode not in MODES:
            raise ConfigurationError(f"compression must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.write_bytes_per_s = write_bytes_per_s
        self._lock = threading.Lock()
        self._decided: dict[str, bool] = {}

    def start_snapshot(self) -> None:
        """Forget the previous snapshot's decisions (the data changes as training goes)."""
        with self._lock:
            self._decided.clear()

    def wants(self, kind: tuple[str, int] | None, piece: memoryview) -> bool:
        """Whether to try compressing ``piece`` (of that float kind)."""
        if kind is None or self.mode == "off" or len(piece) < MIN_PIECE_BYTES:
            return False
        if self.mode == "on":
            return True
        name, itemsize = kind
        with self._lock:
            decided = self._decided.get(name)
        if decided is None:
            decided = floatcodec.should_compress(piece, itemsize, name, self.write_bytes_per_s)
            with self._lock:
                self._decided.setdefault(name, decided)
        return decided

    def encode(self, kind: tuple[str, int] | None, piece: memoryview) -> bytes | None:
        """The codec's payload for ``piece``, or None to store it raw."""
        if not self.wants(kind, piece):
            return None
        assert kind is not None
        return floatcodec.encode(piece, kind[1], float_kind=kind[0])
