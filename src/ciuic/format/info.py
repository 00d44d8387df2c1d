"""What the API returns about a snapshot."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, fields
from typing import Any

from ciuic.errors import CorruptObject
from ciuic.format import canonical
from ciuic.format.manifest import HealthVerdict, Manifest, parse_time


@dataclass(frozen=True)
class SnapshotInfo:
    id: str
    project: str
    job: str
    step: int
    parent: str
    created: str
    total_bytes: int
    new_bytes: int
    tensors: int
    world_size: int = 1
    body: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    status: str = "committed"  # committed | pruned (body deleted, manifest kept)
    seq: int = 0  # commit order in the catalog (0 when not from the catalog)
    #: the manifest's health verdict; None when never judged
    health: HealthVerdict | None = None

    @property
    def healthy(self) -> bool | None:
        """True or False as judged at the commit; None for a snapshot written before ciuic
        judged health."""
        return None if self.health is None else self.health.healthy

    @property
    def short_id(self) -> str:
        return self.id[:12]

    @property
    def created_at(self) -> dt.datetime:
        return parse_time(self.created)

    @property
    def ref(self) -> str:
        return f"{self.project}/{self.job}@{self.step}"

    def to_json(self) -> dict[str, Any]:
        """The fields as JSON values (the server's and ``--json``'s shape)."""
        return {f.name: (getattr(self, f.name).to_json() if f.name == "health"
                         and self.health is not None else getattr(self, f.name))
                for f in fields(self)}

    @classmethod
    def from_manifest(cls, m: Manifest, snapshot_id: str,
                      status: str = "committed") -> SnapshotInfo:
        return cls(
            id=snapshot_id, project=m.project, job=m.job, step=m.step, parent=m.parent,
            created=m.created, total_bytes=m.total_bytes, new_bytes=m.new_bytes,
            tensors=m.tensors, world_size=m.world_size, body=m.body, metrics=dict(m.metrics),
            status=status, health=m.health,
        )


def row_values(snapshot_id: str, metrics: str, health: str | None
               ) -> tuple[dict[str, Any], HealthVerdict | None]:
    """A catalog row's metrics and health (the JSON text the catalog keeps) as values;
    :class:`CorruptObject` naming the row when they are not what the catalog writes."""
    key = f"the catalog's row of snapshot {snapshot_id}"
    values = canonical.parse(metrics, key, "metrics", floats=True)
    if not isinstance(values, dict):
        raise CorruptObject(key, f"its metrics are not an object: {metrics[:80]!r}")
    if health is None:
        return values, None
    try:
        return values, HealthVerdict.from_json(canonical.parse(health, key, "health",
                                                               floats=True))
    except TypeError as e:
        raise CorruptObject(key, str(e)) from None
