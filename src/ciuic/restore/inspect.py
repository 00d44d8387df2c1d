"""Looking inside snapshots without restoring them (``ciuic inspect``, the dashboard): each
tensor's statistics, one tensor's histogram, and the loss and norms along a job's chain.

Statistics come from the body, where the writer recorded them (:mod:`ciuic.format.stats`), so
listing them reads no tensor data. A snapshot written before statistics existed has none; they
are then computed from its data when the caller allows it (``compute=True``), reading every
tensor it lacks them for.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ciuic.chain.read import READ_THREADS, checked_leaves, damaged_body, read_body
from ciuic.chain.repo import Repository
from ciuic.errors import SnapshotNotFound
from ciuic.format import stats as st
from ciuic.format.info import SnapshotInfo
from ciuic.format.layout import body_key
from ciuic.restore.diff import read_tensor


@dataclass
class TensorRow:
    path: str
    dtype: str
    shape: list[int]
    nbytes: int
    stats: st.Stats | None
    computed: bool = False  # True: computed now from the data, not recorded by the writer

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "dtype": self.dtype, "shape": self.shape,
                               "bytes": self.nbytes, "computed": self.computed, "stats": {}}
        s = self.stats
        if s is not None:  # what does not exist or is not finite (NaN, Inf) is null
            out["stats"] = {"nan": s.nan, "inf": s.inf,
                            **{k: _finite(v) for k, v in s.summary().items()}}
        return out


def _float(v: object) -> float | None:
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _finite(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else v


def is_float_dtype(name: str) -> bool:
    """Whether a descriptor's dtype name is a float one (the tensors that get statistics)."""
    return name.startswith(("float", "bfloat", "<f"))


def tensors(repo: Repository, info: SnapshotInfo, compute: bool = False,
            compute_max_bytes: int | None = None) -> list[TensorRow]:
    """Every tensor of a snapshot with its statistics: as recorded, or (``compute``) computed
    from the data for float tensors that have none, while the bytes so read stay within
    ``compute_max_bytes``. A malformed body is its :class:`CorruptObject`."""
    _, states = read_body(repo, info)
    rows = []
    budget = compute_max_bytes
    key = body_key(info.project, info.job, info.body)
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ciuic-inspect") as pool, \
            damaged_body(key):
        for path, kind, desc in checked_leaves(states, key):
            row = TensorRow(path, str(desc.get("dtype")), list(desc.get("shape", [])),
                            int(desc.get("nbytes", 0)), st.of_descriptor(desc))
            if (row.stats is None and compute and is_float_dtype(row.dtype)
                    and (budget is None or row.nbytes <= budget)):
                value = read_tensor(repo, path, kind, desc, pool)
                row.stats, row.computed = st.compute(value.reshape(-1)), True
                if budget is not None:
                    budget -= row.nbytes
            rows.append(row)
    return rows


@dataclass
class Histogram:
    row: TensorRow
    edges: list[float]  # bins + 1 edges over the finite elements' range
    counts: list[int]


def histogram(repo: Repository, info: SnapshotInfo, tensor: str, bins: int = 20) -> Histogram:
    """One tensor's statistics and the histogram of its finite values (reads the tensor)."""
    _, states = read_body(repo, info)
    key = body_key(info.project, info.job, info.body)
    leaves = {p: (k, d) for p, k, d in checked_leaves(states, key)}
    if tensor not in leaves:
        near = sorted(p for p in leaves if tensor.split("/")[-1] in p)[:5] or sorted(leaves)[:5]
        raise SnapshotNotFound(f"snapshot {info.short_id} has no tensor {tensor!r} (tensors "
                               f"such as {', '.join(near)}; `ciuic inspect {info.short_id}` "
                               "lists them)")
    kind, desc = leaves[tensor]
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ciuic-inspect") as pool, \
            damaged_body(key):
        value = read_tensor(repo, tensor, kind, desc, pool)
    flat = value.reshape(-1)
    if flat.is_complex() or flat.dtype == torch.bool:
        flat = flat.real if flat.is_complex() else flat.to(torch.uint8)
    wide = flat.to(torch.float64)
    stats = st.of_descriptor(desc) or st.compute(wide)
    row = TensorRow(tensor, str(desc.get("dtype")), list(desc.get("shape", [])),
                    int(desc.get("nbytes", 0)), stats, computed=st.of_descriptor(desc) is None)
    finite = wide[torch.isfinite(wide)]
    if not finite.numel():
        return Histogram(row, [], [])
    lo, hi = float(finite.min()), float(finite.max())
    if lo == hi:
        return Histogram(row, [lo, hi], [int(finite.numel())])
    counts = torch.histc(finite, bins=bins, min=lo, max=hi)
    step = (hi - lo) / bins
    return Histogram(row, [lo + i * step for i in range(bins)] + [hi],
                     [int(c) for c in counts])


def chain_series(repo: Repository, project: str, job: str, metric: str = "loss"
                 ) -> list[dict[str, Any]]:
    """The loss (``metric``) and each state's L2 norm at every snapshot of a job, oldest
    first, with its health: what the dashboard plots. From the catalog alone (no body read);
    snapshots written before health was recorded have no norms."""
    out = []
    for s in repo.catalog.snapshots(project, job, status=None):
        value = s.metrics.get(metric)
        norms = (s.health.norms if s.health is not None else None) or {}
        out.append({
            "id": s.id, "step": s.step, "created": s.created, "status": s.status,
            metric: value if isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) else None,
            "healthy": s.healthy, "reasons": list(s.health.reasons) if s.health else [],
            "norms": {k: _finite(_float(v)) for k, v in norms.items()},
        })
    return out
