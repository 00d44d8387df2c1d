"""Comparing two snapshots (``ciuic diff A B``): each tensor unchanged, changed, added or
removed, and the plain values and metrics that changed.

Reads only what it must: a tensor whose descriptor names the same bytes in both snapshots (the
same chunk digests, or the same inline bytes, or the same shards) is unchanged without a read;
the others are read, verified, and compared element by element. The snapshots may belong to two
jobs, and have different layouts (a single-process snapshot against a multi-rank one, or one
resharded onto another world size): sharded tensors are assembled whole before the comparison.
Tensors are matched by path; ``module.`` and ``_orig_mod.`` prefixes of model keys are ignored.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, overload

import torch

from ciuic.chain.read import READ_THREADS, checked_leaves, damaged_body, read_body
from ciuic.chain.repo import Repository
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.info import SnapshotInfo
from ciuic.format.layout import body_key
from ciuic.format.tree import decode
from ciuic.restore.boxread import read_box
from ciuic.restore.leaves import leaf_buffer, materialize
from ciuic.state.capture import normalize_key

#: states whose values change at every step by design, compared last and not as "values"
_NOISY = ("rng",)
_RANK_RNG = re.compile(r"^ranks/\d+/rng(/|$)")


@dataclass
class TensorDiff:
    path: str
    status: str  # "unchanged", "changed", "added", "removed"
    dtype: str
    shape: list[int]
    read: bool = False  # whether its bytes had to be read
    note: str = ""  # a dtype or shape change
    changed_elements: int | None = None
    max_abs_diff: float | None = None
    norm_a: float | None = None
    norm_b: float | None = None
    rel_norm_change: float | None = None
    nonfinite_a: int | None = None  # NaN and Inf elements
    nonfinite_b: int | None = None


@dataclass
class ValueDiff:
    path: str
    a: Any
    b: Any


@dataclass
class SnapshotDiff:
    a: SnapshotInfo
    b: SnapshotInfo
    tensors: list[TensorDiff] = field(default_factory=list)
    values: list[ValueDiff] = field(default_factory=list)
    metrics: list[ValueDiff] = field(default_factory=list)
    bytes_read: int = 0

    def to_json(self) -> dict[str, Any]:
        """Strict JSON values: a float that is not finite (a difference or a value that is NaN
        or Inf; the tensors' ``nonfinite_*`` counts say which) is null, as in the server's
        answer, never a bare ``NaN`` that JSON parsers refuse."""
        out: dict[str, Any] = json_safe({
            "a": {"id": self.a.id, "ref": self.a.ref}, "b": {"id": self.b.id, "ref": self.b.ref},
            "tensors": [asdict(t) for t in self.tensors],
            "values": [asdict(v) for v in self.values],
            "metrics": [asdict(v) for v in self.metrics], "bytes_read": self.bytes_read})
        return out


def json_safe(v: Any) -> Any:
    """``v`` with every float that is not finite replaced by None (JSON's null), tuples as
    lists."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def _leaves(states: dict[str, Any], info: SnapshotInfo
            ) -> dict[str, tuple[str, dict[str, Any]]]:
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for path, kind, desc in checked_leaves(states, _body(info)):
        key = normalize_key(path[len("model/"):]) if path.startswith("model/") else None
        out["model/" + key if key is not None else path] = (kind, desc)
    return out


def _body(info: SnapshotInfo) -> str:
    return body_key(info.project, info.job, info.body)


def _same_bytes(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two descriptors name the same bytes (without reading them)."""
    if (a.get("dtype"), a.get("shape")) != (b.get("dtype"), b.get("shape")):
        return False
    for key in ("inline", "chunks", "shards"):
        if key in a or key in b:
            return bool(_named(a.get(key)) == _named(b.get(key)))
    return False


def _named(value: Any) -> Any:
    """A descriptor's field with every chunk reference cut to [digest, nbytes]: the same bytes
    in another place (a pack, or their own object) are the same bytes."""
    if isinstance(value, list):
        if value and all(isinstance(c, list) and len(c) in (2, 5) for c in value):
            return [c[:2] for c in value]
        return [_named(v) for v in value]
    if isinstance(value, dict):
        return {k: _named(v) for k, v in value.items()}
    return value


def read_tensor(repo: Repository, path: str, kind: str, raw: dict[str, Any],
                pool: ThreadPoolExecutor) -> torch.Tensor:
    """One tensor of a body, read and verified (a sharded one assembled whole)."""
    desc = TensorDescriptor.from_json(raw, path)
    if desc.shards is not None and kind == "tensor":
        return read_box(repo, path, desc, None, None, pool)
    flat, futures = leaf_buffer(repo, path, kind, desc, pool, None)
    for f in futures:
        f.result()
    value = materialize(path, kind, desc, flat)
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


def _compare(t: TensorDiff, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype or a.shape != b.shape:
        t.status, t.note = "changed", (f"{a.dtype} {list(a.shape)} -> {b.dtype} "
                                       f"{list(b.shape)}")
        return
    if a.dtype == torch.bool:
        t.changed_elements = int((a != b).sum())
    elif a.is_complex() or a.is_floating_point():
        wide = torch.complex128 if a.is_complex() else torch.float64
        x, y = a.to(wide), b.to(wide)
        same = (x == y) | (torch.isnan(x) & torch.isnan(y))
        t.changed_elements = int((~same).sum())
        # over the elements that changed, and of the whole tensors: NaN where one became NaN,
        # Inf where one became Inf (never the finite elements' numbers, which look healthy)
        delta = (x - y).abs()[~same]
        t.max_abs_diff = float(delta.max()) if delta.numel() else 0.0
        t.nonfinite_a = int((~torch.isfinite(x)).sum())
        t.nonfinite_b = int((~torch.isfinite(y)).sum())
        t.norm_a = float(torch.linalg.vector_norm(x))
        t.norm_b = float(torch.linalg.vector_norm(y))
        if t.norm_a:
            t.rel_norm_change = (t.norm_b - t.norm_a) / t.norm_a
    else:  # integers: compared exactly, the difference in float64
        t.changed_elements = int((a != b).sum())
        delta = (a.to(torch.float64) - b.to(torch.float64)).abs()
        t.max_abs_diff = float(delta.max()) if delta.numel() else 0.0
    t.status = "changed" if t.changed_elements else "unchanged"


def _plain(states: dict[str, Any]) -> dict[str, Any]:
    """Every plain (non-tensor) value of the states, by path."""
    out: dict[str, Any] = {}

    def walk(path: str, v: Any) -> None:
        if _RANK_RNG.match(path):
            return  # a rank's RNG state: changes at every step by design
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{path}/{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{path}/{i}", x)
        elif v is not _TENSOR:
            out[path] = v

    for name, tree in states.items():
        if name in ("dist", *_NOISY):
            continue
        walk(name, decode(tree, name, lambda *a: _TENSOR, adapt=False))
    return out


_TENSOR = object()


def _noisy(path: str) -> bool:
    return path.split("/", 1)[0] in _NOISY or bool(_RANK_RNG.match(path))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(type(a) is type(b) and a == b)


@overload
def diff(repo_a: Repository, a: SnapshotInfo, repo_b: Repository, b: SnapshotInfo
         ) -> SnapshotDiff: ...


@overload
def diff(repo_a: Repository, a: SnapshotInfo, repo_b: Repository, b: SnapshotInfo, *,
         max_read_bytes: int) -> SnapshotDiff | None: ...


def diff(repo_a: Repository, a: SnapshotInfo, repo_b: Repository, b: SnapshotInfo, *,
         max_read_bytes: int | None = None) -> SnapshotDiff | None:
    """Compare snapshot ``a`` (of ``repo_a``) with ``b`` (of ``repo_b``, often the same).
    With ``max_read_bytes``: None, reading nothing, when the tensors whose bytes differ hold
    more than that."""
    manifest_a, states_a = read_body(repo_a, a)
    manifest_b, states_b = read_body(repo_b, b)
    out = SnapshotDiff(a, b)
    la, lb = _leaves(states_a, a), _leaves(states_b, b)
    order = sorted(set(la) | set(lb), key=lambda p: (_noisy(p), p))
    if max_read_bytes is not None and sum(
            int(la[p][1].get("nbytes", 0)) + int(lb[p][1].get("nbytes", 0)) for p in order
            if p in la and p in lb and not _same_bytes(la[p][1], lb[p][1])) > max_read_bytes:
        return None
    with ThreadPoolExecutor(READ_THREADS, thread_name_prefix="ciuic-diff") as pool:
        for path in order:
            if path not in lb or path not in la:
                _, desc = la[path] if path in la else lb[path]
                out.tensors.append(TensorDiff(path, "removed" if path in la else "added",
                                              str(desc.get("dtype")),
                                              list(desc.get("shape", []))))
                continue
            (ka, da), (kb, db) = la[path], lb[path]
            t = TensorDiff(path, "unchanged", str(db.get("dtype")), list(db.get("shape", [])))
            out.tensors.append(t)
            if _same_bytes(da, db):
                continue
            t.read = True
            out.bytes_read += int(da.get("nbytes", 0)) + int(db.get("nbytes", 0))
            with damaged_body(_body(a)):
                ta = read_tensor(repo_a, path, ka, da, pool)
            with damaged_body(_body(b)):
                tb = read_tensor(repo_b, path, kb, db, pool)
            _compare(t, ta, tb)
    pa, pb = _plain(states_a), _plain(states_b)
    for path in sorted(set(pa) | set(pb)):
        va, vb = pa.get(path, _MISSING), pb.get(path, _MISSING)
        if not _equal(va, vb):
            out.values.append(ValueDiff(path, _shown(va), _shown(vb)))
    # the manifests' metrics: the catalog's (a.metrics) keep NaN and Inf as null
    metrics_a, metrics_b = manifest_a.metrics, manifest_b.metrics
    for name in sorted(set(metrics_a) | set(metrics_b)):
        ma, mb = metrics_a.get(name, _MISSING), metrics_b.get(name, _MISSING)
        if not _equal(ma, mb):
            out.metrics.append(ValueDiff(name, _shown(ma), _shown(mb)))
    return out


_MISSING = object()


def _shown(v: Any) -> Any:
    return "<absent>" if v is _MISSING else v
