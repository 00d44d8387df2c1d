"""Per-tensor statistics, computed while a snapshot is written (docs/format.md, "Statistics").

Every float tensor's descriptor carries ``"stats"``: its NaN and Inf counts and, over its finite
elements, the minimum, maximum, mean and L2 norm. Floats are written as strings (Python's
round-trip ``repr``; canonical JSON has no floats); a value that does not exist (the min or the
norm of a tensor with no finite element) is absent::

    "stats": {"inf": 0, "max": "0.73", "mean": "-0.0012", "min": "-0.81", "nan": 0,
              "norm": "12.6"}

The writer computes them piece by piece (each chunk's elements, on the threads that hash the
chunks), so that a piece whose bytes did not change reuses its statistics, and a sharded tensor's
shards combine into the whole tensor's (:func:`combine`). Snapshots written before statistics
existed have none: every reader treats a missing ``stats`` as "not known".

What is shown of a tensor (``ciuic inspect``, the dashboard) is :meth:`Stats.summary`: the whole
tensor's values, NaN or not known where it holds NaN or Inf, never the finite elements' numbers
as if they were the tensor's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: dtypes whose statistics are computed in float32: the float8 kinds (their reductions are not
#: implemented) and the 16-bit floats (a sum or norm in their own precision drifts: a million
#: bfloat16 ones sum to 999424)
_UPCAST = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                        "float8_e5m2fnuz", "float16", "bfloat16")
           if hasattr(torch, n)}


@dataclass(frozen=True)
class Stats:
    """The statistics of a tensor, or of a part of one (a piece, a shard)."""

    count: int  # elements
    nan: int = 0
    inf: int = 0
    total: float = 0.0  # sum of the finite elements
    sumsq: float = 0.0  # sum of their squares
    lo: float | None = None  # None when no element is finite
    hi: float | None = None

    @property
    def finite(self) -> int:
        return self.count - self.nan - self.inf

    @property
    def nonfinite(self) -> int:
        return self.nan + self.inf

    @property
    def mean(self) -> float | None:
        return self.total / self.finite if self.finite else None

    @property
    def norm(self) -> float:
        return math.sqrt(self.sumsq)

    def summary(self) -> dict[str, float | None]:
        """The whole tensor's ``min``, ``max``, ``mean`` and ``norm`` (L2), as shown: all NaN
        when it holds a NaN; with an Inf, the norm Inf and the others not known (None: the signs
        of its infinities are not recorded); None where no element exists."""
        if self.nan:
            return dict.fromkeys(("min", "max", "mean", "norm"), math.nan)
        if self.inf:
            return {"min": None, "max": None, "mean": None, "norm": math.inf}
        return {"min": self.lo, "max": self.hi, "mean": self.mean, "norm": self.norm}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nan": self.nan, "inf": self.inf}
        if self.finite or not self.count:  # no norm of a tensor with no finite element
            out["norm"] = _text(self.norm)
        if self.lo is not None and self.hi is not None and self.mean is not None:
            out |= {"min": _text(self.lo), "max": _text(self.hi), "mean": _text(self.mean)}
        return out

    @classmethod
    def from_json(cls, obj: Any, count: int) -> Stats | None:
        """The statistics a descriptor holds (``count``: its elements), or None when it holds
        none or they are malformed (a reader never fails over statistics)."""
        if not isinstance(obj, dict):
            return None
        try:
            nan, inf = int(obj["nan"]), int(obj["inf"])
            finite = count - nan - inf
            norm = float(obj["norm"]) if finite or "norm" in obj else 0.0
            mean = float(obj["mean"]) if "mean" in obj else None
            return cls(count, nan, inf, (mean or 0.0) * finite, norm * norm,
                       float(obj["min"]) if "min" in obj else None,
                       float(obj["max"]) if "max" in obj else None)
        except (KeyError, TypeError, ValueError):
            return None


def _text(v: float) -> str:
    return float.__repr__(float(v))


def combine(parts: Iterable[Stats | None]) -> Stats | None:
    """The statistics of a whole made of ``parts``; None if any part's are unknown."""
    out: Stats | None = None
    for p in parts:
        if p is None:
            return None
        if out is None:
            out = p
            continue
        los = [v for v in (out.lo, p.lo) if v is not None]
        his = [v for v in (out.hi, p.hi) if v is not None]
        out = Stats(out.count + p.count, out.nan + p.nan, out.inf + p.inf, out.total + p.total,
                    out.sumsq + p.sumsq, min(los) if los else None, max(his) if his else None)
    return out


def is_float(value: Any) -> bool:
    """Whether statistics are computed for ``value`` (real floating-point tensors and arrays)."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and value.element_size() <= 8
    # NumPy's longdouble (float96/float128) has no torch counterpart: no statistics
    return isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.itemsize <= 8


def compute(flat: torch.Tensor | np.ndarray) -> Stats:
    """The statistics of a flat float tensor or array (a piece of one: any 1-d slice).

    The common case (every element finite) costs four fast reductions (sum, sum of squares,
    min, max) in the tensor's precision (float32 for the 16- and 8-bit floats), on the calling
    thread; only a tensor holding NaN or Inf, or whose reductions overflow, is reduced again in
    float64 over its finite elements.

    The reductions of a float piece in memory (float64, float32, and float16 and bfloat16
    widened to float32) are NumPy's, which run on the calling thread. The writer computes these
    on its naming threads beside the hashing and the writes; torch's reductions split each
    piece over the intra-op (OpenMP) threads, whose barriers then wait for the cores the
    hashing, the writes and the training hold (on the 2-core development VM the statistics took
    0.25-0.55 s of those threads' time for 0.08 s of their own CPU: docs/benchmarks.md, "Where
    a snapshot's time goes")."""
    if isinstance(flat, torch.Tensor):
        if flat.device.type == "cpu" and flat.dtype in _NUMPY and not flat.is_neg():
            a = flat.detach().contiguous()
            if a.dtype == torch.bfloat16:  # its bits are a float32's top half: widened exactly
                bits = a.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
                bits <<= 16
                return _compute(bits.view(np.float32))
            return _compute(_widened(a.numpy()))
        return _reduce_torch(flat.float() if flat.dtype in _UPCAST else flat)
    return _compute(_widened(np.ascontiguousarray(flat)))


#: the dtypes :func:`compute` reduces with NumPy (the float8 kinds go through torch)
_NUMPY = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _widened(a: np.ndarray) -> np.ndarray:
    """A float16 array widened to float32 (a sum in float16 drifts); others as they are."""
    return a.astype(np.float32) if a.itemsize < 4 else a


def _compute(a: np.ndarray) -> Stats:
    """:func:`compute` of a flat, contiguous float32 or float64 array."""
    n = int(a.size)
    if n == 0:
        return Stats(0)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow: reduced again below
        total = float(a.sum())
        sumsq = float(np.dot(a, a))
        lo, hi = float(a.min()), float(a.max())
    if all(math.isfinite(v) for v in (total, sumsq, lo, hi)):
        return Stats(n, 0, 0, total, sumsq, lo, hi)
    return _nonfinite(torch.from_numpy(a))


def _reduce_torch(flat: torch.Tensor) -> Stats:
    """:func:`compute` with torch's reductions (a tensor NumPy cannot hold)."""
    n = flat.numel()
    if n == 0:
        return Stats(0)
    total = float(flat.sum())
    norm = float(torch.linalg.vector_norm(flat))
    lo, hi = (float(v) for v in torch.aminmax(flat))
    if all(math.isfinite(v) for v in (total, norm, lo, hi)):
        return Stats(n, 0, 0, total, norm * norm, lo, hi)
    return _nonfinite(flat)


def _nonfinite(flat: torch.Tensor) -> Stats:
    """The statistics of a tensor holding NaN or Inf (or whose reductions overflowed): its
    counts, and the finite elements' reductions in float64."""
    n = flat.numel()
    nan = int(torch.isnan(flat).sum())
    inf = int(torch.isinf(flat).sum())
    finite = flat[torch.isfinite(flat)].to(torch.float64)
    if not finite.numel():
        return Stats(n, nan, inf)
    lo64, hi64 = (float(v) for v in torch.aminmax(finite))
    return Stats(n, nan, inf, float(finite.sum()), float(finite.dot(finite)), lo64, hi64)


def of_descriptor(desc: dict[str, Any]) -> Stats | None:
    """A tensor descriptor's statistics: its own, or its shards' combined (None if unknown)."""
    count = math.prod(int(d) for d in desc.get("shape", []))
    if "shards" in desc and "stats" not in desc:
        return combine(Stats.from_json(s.get("stats"), math.prod(int(d) for d in s["shape"]))
                       for s in desc["shards"]) if desc["shards"] else None
    return Stats.from_json(desc.get("stats"), count)
