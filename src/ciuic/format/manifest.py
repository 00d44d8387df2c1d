"""Snapshot manifests and bodies (docs/format.md, "Manifest" and "Body").

A snapshot is two JSON objects in canonical form:

* the **body** (``jobs/<project>/<job>/bodies/<digest>.json``) holds the state trees with every
  tensor's descriptor (dtype, shape, chunk digests); it is named by its own digest;
* the **manifest** (``jobs/<project>/<job>/manifests/<id>.json``) is small: project, job, step,
  parent ID, time, sizes, metrics and the body's digest. The snapshot ID is the BLAKE3-256
  digest of the manifest's canonical bytes. Creating the manifest is the commit.

Pruning deletes a body but keeps its manifest, so the chain of IDs stays verifiable end to end.
"""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ciuic.errors import CorruptObject, IntegrityError, UnsupportedFormat
from ciuic.format import canonical, tree
from ciuic.format.descriptor import holds_packed
from ciuic.format.digest import digest, is_digest
from ciuic.format.parts import PACKED_BODY_FORMAT, SPLIT_BODY_FORMAT

FORMAT_VERSION = 1
#: The manifest format that records the snapshot's health (``"health"``; its body's float
#: descriptors carry statistics). Format-1 readers refuse it and say to upgrade.
HEALTH_FORMAT = 2
MANIFEST_FORMATS = (FORMAT_VERSION, HEALTH_FORMAT)
#: The body format of a multi-rank snapshot (sharded descriptors, per-rank states).
DIST_BODY_FORMAT = 2
MANIFEST_KIND = "ciuic.snapshot"
BODY_KIND = "ciuic.body"


def utc_now(at: float | None = None) -> str:
    """The current time (or the Unix time ``at``) as the format writes it:
    ``2026-11-30T01:33:08.123456Z``."""
    when = dt.datetime.now(dt.timezone.utc) if at is None else dt.datetime.fromtimestamp(
        at, dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc)


@dataclass(frozen=True)
class HealthVerdict:
    """A snapshot's health, judged at its commit (chain/health.py) and recorded in its manifest
    (format 2, ``"health"``; docs/format.md, "Health").

    ``reasons`` says why it is unhealthy (empty when healthy); ``nonfinite`` counts its NaN and
    Inf elements and ``norms`` holds each state's L2 norm as Python's round-trip ``repr`` text
    (``"nan"`` and ``"inf"`` included); both are None in a verdict that does not record them.
    Fields a later ciuic adds are kept in ``extra``, so that the manifest re-encodes to the
    same bytes."""

    healthy: bool
    reasons: tuple[str, ...] = ()
    nonfinite: int | None = None
    norms: Mapping[str, str] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.extra, "healthy": self.healthy,
                               "reasons": list(self.reasons)}
        if self.nonfinite is not None:
            out["nonfinite"] = self.nonfinite
        if self.norms is not None:
            out["norms"] = dict(self.norms)
        return out

    @classmethod
    def from_json(cls, h: Any) -> HealthVerdict:
        """The verdict of a manifest's ``health`` object; TypeError when it is malformed."""
        if not (isinstance(h, dict) and isinstance(h.get("healthy"), bool)
                and isinstance(h.get("reasons"), list)
                and all(isinstance(r, str) for r in h["reasons"])):
            raise TypeError(f"field 'health' should hold 'healthy' and 'reasons', got {h!r}")
        nonfinite, norms = h.get("nonfinite"), h.get("norms")
        if nonfinite is not None and (not isinstance(nonfinite, int)
                                      or isinstance(nonfinite, bool)):
            raise TypeError(f"health's 'nonfinite' should be an int, got {nonfinite!r}")
        if norms is not None and not (isinstance(norms, dict) and all(
                isinstance(v, str) for v in norms.values())):
            raise TypeError(f"health's 'norms' should map states to numbers, got {norms!r}")
        known = ("healthy", "reasons", "nonfinite", "norms")
        return cls(healthy=h["healthy"], reasons=tuple(h["reasons"]), nonfinite=nonfinite,
                   norms=norms, extra={k: v for k, v in h.items() if k not in known})

    def norm(self, state: str) -> float | None:
        """The L2 norm recorded for ``state`` ("model", "optimizer", ...), or None."""
        text = None if self.norms is None else self.norms.get(state)
        return None if text is None else float(text)


@dataclass(frozen=True)
class Manifest:
    """The committed description of one snapshot; its digest is the snapshot ID."""

    project: str
    job: str
    step: int
    parent: str  # "" for the first snapshot of a lineage
    created: str
    body: str
    body_bytes: int
    total_bytes: int
    new_bytes: int
    tensors: int
    world_size: int = 1
    metrics: dict[str, Any] = field(default_factory=dict)
    #: the health verdict (format 2); None in snapshots written before ciuic judged health
    health: HealthVerdict | None = None
    format: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.health is not None and self.format == FORMAT_VERSION:
            object.__setattr__(self, "format", HEALTH_FORMAT)

    @property
    def healthy(self) -> bool | None:
        """Whether the snapshot was judged healthy; None when it was not judged."""
        return None if self.health is None else self.health.healthy

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "body": self.body,
            "body_bytes": self.body_bytes,
            "created": self.created,
            "format": self.format,
            "job": self.job,
            "kind": MANIFEST_KIND,
            "metrics": tree.encode(self.metrics, "metrics", []),
            "new_bytes": self.new_bytes,
            "parent": self.parent,
            "project": self.project,
            "step": self.step,
            "tensors": self.tensors,
            "total_bytes": self.total_bytes,
            "world_size": self.world_size,
        }
        if self.health is not None:
            out["health"] = self.health.to_json()
        return out

    def encode(self) -> bytes:
        return canonical.dumps(self.to_json())

    @property
    def id(self) -> str:
        return digest(self.encode())

    @property
    def created_at(self) -> dt.datetime:
        return parse_time(self.created)

    @classmethod
    def decode(cls, data: bytes, key: str = "manifest") -> Manifest:
        """Parse and validate manifest bytes. Raises :class:`CorruptObject` on any defect."""
        obj = _load(data, key, MANIFEST_KIND, "manifest", MANIFEST_FORMATS)
        try:
            m = cls(
                project=_typed(obj, "project", str),
                job=_typed(obj, "job", str),
                step=_typed(obj, "step", int),
                parent=_typed(obj, "parent", str),
                created=_typed(obj, "created", str),
                body=_typed(obj, "body", str),
                body_bytes=_typed(obj, "body_bytes", int),
                total_bytes=_typed(obj, "total_bytes", int),
                new_bytes=_typed(obj, "new_bytes", int),
                tensors=_typed(obj, "tensors", int),
                world_size=_typed(obj, "world_size", int),
                metrics=tree.decode(obj.get("metrics", {}), "metrics", _no_leaf),
                health=(HealthVerdict.from_json(obj["health"]) if obj["format"] == HEALTH_FORMAT
                        else None),
                format=obj["format"],
            )
            parse_time(m.created)
        except (KeyError, TypeError, ValueError, IntegrityError) as e:  # metrics: IntegrityError
            raise CorruptObject(key, f"malformed manifest: {e}") from e
        if not is_digest(m.body) or (m.parent and not is_digest(m.parent)):
            raise CorruptObject(key, "malformed manifest: bad body or parent digest")
        if m.encode() != data:
            raise CorruptObject(key, "manifest bytes are not in canonical form")
        return m


def _load(data: bytes, key: str, kind: str, what: str,
          formats: tuple[int, ...] = (FORMAT_VERSION,)) -> dict[str, Any]:
    """Parse a canonical-JSON object of ``kind`` and check its format version."""
    obj = canonical.parse(data, key, f"snapshot {what} (canonical JSON)")
    if not isinstance(obj, dict) or obj.get("kind") != kind:
        raise CorruptObject(key, f"not a ciuic snapshot {what}")
    if obj.get("format") not in formats:
        raise UnsupportedFormat(
            key, f"{what} format {obj.get('format')!r} is not supported by this version of ciuic "
            f"(it reads format {', '.join(map(str, formats))}); upgrade ciuic"
        )
    return obj


def _typed(obj: dict[str, Any], name: str, kind: type) -> Any:
    value = obj[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"field {name!r} should be {kind.__name__}, got {value!r}")
    return value


def _no_leaf(path: str, kind: str, desc: dict[str, Any]) -> Any:
    raise TypeError(f"{path}: tensors are not allowed in metrics")


def encode_body(states: dict[str, Any], salt: str | None = None,
                distributed: bool = False, split: bool = False) -> bytes:
    """Canonical bytes of a body holding ``states`` (already-encoded trees).

    The random ``salt`` makes every snapshot's body a distinct object, so pruning one snapshot
    never deletes a body another snapshot with bit-identical state still uses. A multi-rank
    snapshot's body is format 2 (it may hold sharded descriptors, which format-1 readers would
    misread): readers of format 1 only refuse it with "upgrade ciuic". ``split``: the index of a
    body in parts (format 3, :mod:`ciuic.format.parts`). A body that references a piece
    inside a pack is format 4, whatever its shape (older readers refuse it with "upgrade
    ciuic"; its shape is told by its content, as 1 to 3's are).
    """
    salt = secrets.token_hex(8) if salt is None else salt
    fmt = (PACKED_BODY_FORMAT if holds_packed(states) else SPLIT_BODY_FORMAT if split
           else DIST_BODY_FORMAT if distributed else FORMAT_VERSION)
    return canonical.dumps({"format": fmt, "kind": BODY_KIND, "salt": salt, "states": states})


def decode_body(data: bytes, key: str, expected_digest: str,
                name_key: bytes | None = None) -> dict[str, Any]:
    """Check a body (plaintext) against its digest and return its ``states`` trees."""
    actual = digest(data, key=name_key)
    if actual != expected_digest:
        raise CorruptObject(key, f"content hash {actual[:16]}... does not match its name")
    obj = _load(data, key, BODY_KIND, "body",
                (FORMAT_VERSION, DIST_BODY_FORMAT, SPLIT_BODY_FORMAT, PACKED_BODY_FORMAT))
    states = obj.get("states")
    if not isinstance(states, dict):
        raise CorruptObject(key, "body has no states")
    return states
