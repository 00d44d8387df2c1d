"""What the dashboard shows of one snapshot: its tensors and their statistics, and a check."""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch

from ciuic.chain.read import read_body
from ciuic.chain.repo import Repository
from ciuic.chain.verify import verify_job
from ciuic.format.info import SnapshotInfo
from ciuic.format.tree import flat_tensors, walk_leaves
from ciuic.restore.reader import load_trees

#: statistics are computed for snapshots up to this size (they read every byte)
STATS_MAX_BYTES = 512 * 1024 * 1024
_ONE_AT_A_TIME = threading.Semaphore(1)


def _stats(value: Any) -> dict[str, Any]:
    t = torch.as_tensor(value) if isinstance(value, np.ndarray) else value
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return {}
    if t.is_complex() or t.dtype == torch.bool or not (t.is_floating_point()
                                                        or t.dtype in (torch.int8, torch.int16,
                                                                       torch.int32, torch.int64,
                                                                       torch.uint8)):
        return {}
    f = t.detach().to(torch.float64).reshape(-1)
    finite = f[torch.isfinite(f)]
    out: dict[str, Any] = {"nan": int(torch.isnan(f).sum()), "inf": int(torch.isinf(f).sum())}
    if finite.numel():
        out |= {"min": float(finite.min()), "max": float(finite.max()),
                "mean": float(finite.mean()),
                "std": float(finite.std()) if finite.numel() > 1 else 0.0,
                "norm": float(finite.norm())}
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in out.items()}


def tensors(repo: Repository, info: SnapshotInfo) -> dict[str, Any]:
    """Every tensor of a snapshot (path, dtype, shape, bytes) with statistics when the snapshot
    is at most ``STATS_MAX_BYTES``."""
    _, trees = read_body(repo, info)
    rows: list[dict[str, Any]] = [
        {"path": p, "dtype": str(d["dtype"]), "shape": list(d["shape"]), "bytes": int(d["nbytes"])}
        for p, _k, d in walk_leaves(trees)]
    # the size the body describes (what would be read), not the manifest's declared total
    with_stats = sum(row["bytes"] for row in rows) <= STATS_MAX_BYTES
    if with_stats:
        with _ONE_AT_A_TIME:  # statistics read whole snapshots: never several at once
            states = load_trees(repo, trees, adapt=False)
        values: dict[str, torch.Tensor] = {}
        for name, value in states.items():
            flat_tensors(value, name, values)
        for row in rows:
            row["stats"] = _stats(values.get(row["path"]))
    return {"id": info.id, "step": info.step, "tensors": rows, "stats": with_stats,
            "stats_limit_bytes": STATS_MAX_BYTES}


def verify(repo: Repository, info: SnapshotInfo, deep: bool) -> dict[str, Any]:
    """Check one snapshot: its manifest, its chain link, its body and its chunks (``deep``:
    re-read and re-hash every chunk)."""
    report = verify_job(repo, info.project, info.job, deep=deep, only=info.id)
    return {"id": info.id, "ok": report.ok, "deep": deep,
            "pruned": info.status != "committed" or report.pruned > 0,
            "chunks_checked": report.chunks_checked,
            "problems": [{"key": p.key, "reason": p.reason} for p in report.problems or []]}
