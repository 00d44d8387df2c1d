"""The server's answers as Pydantic models: what the OpenAPI document (``/openapi.json``,
``ciuic serve --openapi``) says each route returns, and the one error body every refusal has.

The routes build their answers as plain dicts (``SnapshotInfo.to_json`` and the like: the same
JSON the CLI's ``--json`` prints), and FastAPI checks each against the route's model before it
is sent. The models never drop a key (``extra="allow"``: a key a model does not declare goes
out as it came) and the routes serialize with ``exclude_unset``, so a key the dict lacks is not
added as null: the JSON is what the dict holds. Their JSON schemas are closed all the same
(no ``additionalProperties``), except where the data is open (a health verdict keeps the fields
a later ciuic adds): ``tests/test_openapi.py`` checks every real answer against its route's
document, so a key the models do not declare fails a test rather than going out undocumented.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

Number = int | float  # a JSON number as the producer wrote it (an int stays an int)
ID = "3f5c0a9e1b7d4c26a8e0f1d2c3b4a5968778695a4b3c2d1e0f9e8d7c6b5a4938"
PARENT = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9"
BODY = "9f8e7d6c5b4a39281706f5e4d3c2b1a09f8e7d6c5b4a39281706f5e4d3c2b1a0"
AT = "2026-12-05T11:30:00.123456+00:00"


def _schema_extra(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """A model's JSON schema: closed unless the model is ``open``, with its ``example``."""
    if not getattr(cls, "open", False):
        schema.pop("additionalProperties", None)
    example = getattr(cls, "example", None)
    if example is not None:
        schema["examples"] = [example]


class Answer(BaseModel):
    """The base of every answer (see the module docstring)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=_schema_extra)
    open: ClassVar[bool] = False
    example: ClassVar[dict[str, Any] | None] = None


# -- errors ------------------------------------------------------------------------------------

class ErrorDetail(Answer):
    code: str = Field(description="machine-readable: invalid_name, invalid_key, "
                      "invalid_request, missing_key, wrong_project, forbidden, not_found, "
                      "pruned, too_large, invalid_run, encrypted, newer_format, damaged, busy, "
                      "storage_unavailable, method_not_allowed, internal")
    message: str = Field(description="what went wrong and what to do, in words")
    example = {"code": "forbidden", "message": "this needs the writer role; the key is a reader"}


class ErrorBody(Answer):
    """Every refusal: 4xx and 5xx answers (a HEAD's carry no body)."""

    error: ErrorDetail
    example = {"error": ErrorDetail.example}


#: what each error status means on this API (docs/server.md, "Validation and errors")
ERRORS: dict[int, str] = {
    400: "a bad project, job, snapshot or object name, or a bad query or body "
         "(`invalid_name`, `invalid_key`, `invalid_request`)",
    401: "no API key, or one that is unknown, revoked or expired (`missing_key`, "
         "`invalid_key`)",
    403: "the key is another project's (`wrong_project`), its role is too weak or the object "
         "may not be written or deleted so (`forbidden`)",
    404: "no such snapshot, job snapshot or object (`not_found`; an ambiguous ID prefix too)",
    410: "the snapshot was pruned: its tensors are gone (`pruned`)",
    413: "the request's body is over the limit (`too_large`)",
    416: "the range starts at or past the object's end (`range_past_end`); its "
         "`Content-Range: bytes */SIZE` gives the object's size",
    422: "the server cannot read it: `encrypted` (only clients with the key can), "
         "`newer_format` (upgrade the server), `damaged` (`ciuic verify --deep`), or a bad "
         "run ID (`invalid_run`)",
    429: "the server is busy with the same kind of read (`busy`): try again",
    503: "the server's storage failed (`storage_unavailable`)",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route that answers these error statuses: each an
    :class:`ErrorBody`."""
    return {s: {"model": ErrorBody, "description": ERRORS[s]} for s in statuses}


def bare(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a HEAD route's errors: the status alone, no body."""
    return {s: {"description": ERRORS.get(s, "") + " (no body: HEAD)"} for s in statuses}


#: the errors of every route under /v1/projects/{project}: a bad project name, no key, another
#: project's key or too weak a role, the storage failing
PROJECT = (400, 401, 403, 503)

# -- health and identity -----------------------------------------------------------------------


class Health(Answer):
    status: str = Field(description='"ok" whenever the server answers')
    version: str = Field(description="the server's ciuic version")
    example = {"status": "ok", "version": "0.9.0"}


class WhoAmI(Answer):
    key: str = Field(description="the API key's public id")
    project: str = Field(description="the one project the key opens")
    role: str = Field(description="reader, writer or admin")
    example = {"key": "4f1c2b3a9d8e", "project": "vision", "role": "writer"}


class Projects(Answer):
    projects: list[str] = Field(description="the projects the key opens: its own")
    example = {"projects": ["vision"]}


# -- jobs and snapshots ------------------------------------------------------------------------

class Job(Answer):
    project: str
    job: str
    snapshots: int = Field(description="committed snapshots")
    max_step: int | None = Field(description="the highest committed step; null: none")
    new_bytes: int = Field(description="bytes the job's snapshots stored (deduplicated)")
    latest: str | None = Field(description="when its latest snapshot was taken; null: none")
    example = {"project": "vision", "job": "resnet50", "snapshots": 12, "max_step": 12000,
               "new_bytes": 734003200, "latest": AT}


class Jobs(Answer):
    jobs: list[Job]
    example = {"jobs": [Job.example]}


class HealthVerdict(Answer):
    """A snapshot's health, judged at its commit (docs/format.md, "Health"); fields a later
    ciuic adds come along."""

    open = True
    healthy: bool
    reasons: list[str] = Field(description="why it is unhealthy; empty when healthy")
    nonfinite: int | None = Field(default=None, description="its NaN and Inf elements (absent "
                                  "when not recorded)")
    norms: dict[str, str] | None = Field(default=None, description="each state's L2 norm as "
                                         "round-trip text ('nan' and 'inf' included; absent "
                                         "when not recorded)")
    example = {"healthy": True, "reasons": [], "nonfinite": 0,
               "norms": {"model": "41.2078", "optimizer": "3.5"}}


class Snapshot(Answer):
    """A snapshot as the catalog indexes it (``SnapshotInfo``)."""

    id: str = Field(description="the snapshot ID: the manifest's SHA-256, 64 hex characters")
    project: str
    job: str
    step: int
    parent: str = Field(description="the previous snapshot's ID; empty for the first")
    created: str = Field(description="commit time, ISO 8601 UTC")
    total_bytes: int = Field(description="the state's bytes")
    new_bytes: int = Field(description="bytes this snapshot stored (the rest was deduplicated)")
    tensors: int
    world_size: int = Field(description="ranks that wrote it")
    body: str = Field(description="the body's digest (its tree of tensor descriptors)")
    metrics: dict[str, Any] = Field(description="the numbers recorded with it (loss, ...)")
    status: str = Field(description="committed, or pruned (body deleted, manifest kept)")
    seq: int = Field(description="commit order in the catalog")
    health: HealthVerdict | None = Field(description="null: written before ciuic judged health")
    example = {"id": ID, "project": "vision", "job": "resnet50", "step": 12000,
               "parent": PARENT, "created": AT, "total_bytes": 102760448,
               "new_bytes": 4194304, "tensors": 322, "world_size": 1, "body": BODY,
               "metrics": {"loss": 0.41, "epoch": 3}, "status": "committed", "seq": 12,
               "health": HealthVerdict.example}


class ListedSnapshot(Snapshot):
    notes: list[str] = Field(description="where runs stopped after it and why, who resumed "
                             "from it")
    example = {**Snapshot.example, "notes": ["resumed by run 5d2c8e1f (restart 1 by ciuic run)"]}


class SnapshotPage(Answer):
    total: int = Field(description="committed snapshots of the job")
    offset: int
    limit: int
    snapshots: list[ListedSnapshot] = Field(description="newest first")
    example = {"total": 12, "offset": 0, "limit": 50, "snapshots": [ListedSnapshot.example]}


class RunAnswer(Answer):
    run: str = Field(description="the run's ID")
    events: int = Field(description="the events the report carried")
    added: int = Field(description="those the server did not have yet")
    example = {"run": "5d2c8e1f0a9b3c47", "events": 3, "added": 2}


class Deleted(Answer):
    deleted: str = Field(description="the snapshot's ID")
    status: str = Field(description='"pruned": its body is deleted, its manifest stays')
    example = {"deleted": ID, "status": "pruned"}


class TensorStats(Answer):
    """Empty when the snapshot records none and they were not computed."""

    nan: int | None = Field(default=None, description="NaN elements")
    inf: int | None = Field(default=None, description="Inf elements")
    min: Number | None = Field(default=None, description="null where NaN, Inf or unknown")
    max: Number | None = None
    mean: Number | None = None
    norm: Number | None = Field(default=None, description="L2; null where NaN or Inf")
    example = {"nan": 0, "inf": 0, "min": -0.51, "max": 0.49, "mean": 0.0012, "norm": 12.4}


class TensorRow(Answer):
    path: str = Field(description="the tensor's path in the state, e.g. model/fc.weight")
    dtype: str
    shape: list[int]
    bytes: int
    computed: bool = Field(description="its statistics were computed now, not recorded")
    stats: TensorStats
    example = {"path": "model/fc.weight", "dtype": "float32", "shape": [1000, 2048],
               "bytes": 8192000, "computed": False, "stats": TensorStats.example}


class Tensors(Answer):
    id: str
    step: int
    health: HealthVerdict | None
    tensors: list[TensorRow]
    stats: bool = Field(description="every float tensor has statistics")
    computed: bool = Field(description="some were computed now (from the data)")
    stats_limit_bytes: int = Field(description="the most bytes read to compute statistics")
    example = {"id": ID, "step": 12000, "health": HealthVerdict.example,
               "tensors": [TensorRow.example], "stats": True, "computed": False,
               "stats_limit_bytes": 536870912}


class SeriesPoint(Answer):
    id: str
    step: int
    created: str
    status: str
    loss: Number | None = Field(description="the recorded loss; null if none or not finite")
    healthy: bool | None = Field(description="null: not judged")
    reasons: list[str]
    norms: dict[str, Number | None] = Field(description="each state's L2 norm; null: NaN/Inf")
    example = {"id": ID, "step": 12000, "created": AT, "status": "committed", "loss": 0.41,
               "healthy": True, "reasons": [], "norms": {"model": 41.2078, "optimizer": 3.5}}


class Series(Answer):
    points: list[SeriesPoint] = Field(description="every snapshot of the job, oldest first")
    example = {"points": [SeriesPoint.example]}


class DiffSide(Answer):
    id: str
    ref: str = Field(description="PROJECT/JOB@STEP")


class TensorDiff(Answer):
    path: str
    status: str = Field(description="unchanged, changed, added or removed")
    dtype: str
    shape: list[int]
    read: bool = Field(description="its bytes had to be read")
    note: str = Field(description="a dtype or shape change")
    changed_elements: int | None
    max_abs_diff: Number | None
    norm_a: Number | None
    norm_b: Number | None
    rel_norm_change: Number | None
    nonfinite_a: int | None = Field(description="NaN and Inf elements in A")
    nonfinite_b: int | None


class ValueDiff(Answer):
    path: str
    a: Any = Field(description="the value in A")
    b: Any = Field(description="the value in B")


class Diff(Answer):
    """``ciuic diff A B``: floats that are not finite are null."""

    a: DiffSide
    b: DiffSide
    tensors: list[TensorDiff]
    values: list[ValueDiff] = Field(description="plain values that changed")
    metrics: list[ValueDiff] = Field(description="metrics that changed")
    bytes_read: int
    example = {
        "a": {"id": PARENT, "ref": "vision/resnet50@11000"},
        "b": {"id": ID, "ref": "vision/resnet50@12000"},
        "tensors": [{"path": "model/fc.weight", "status": "changed", "dtype": "float32",
                     "shape": [1000, 2048], "read": True, "note": "",
                     "changed_elements": 2048000, "max_abs_diff": 0.0031, "norm_a": 12.3,
                     "norm_b": 12.4, "rel_norm_change": 0.0081, "nonfinite_a": 0,
                     "nonfinite_b": 0}],
        "values": [{"path": "epoch", "a": 2, "b": 3}],
        "metrics": [{"path": "loss", "a": 0.52, "b": 0.41}], "bytes_read": 16384000}


class Problem(Answer):
    key: str = Field(description="the object")
    reason: str


class Verified(Answer):
    id: str
    ok: bool
    deep: bool = Field(description="every chunk was re-read and re-hashed")
    pruned: bool
    chunks_checked: int
    checked: str = Field(description="what was checked, in words")
    problems: list[Problem]
    example = {"id": ID, "ok": True, "deep": False, "pruned": False, "chunks_checked": 25,
               "checked": "the manifest, its parent link and the body (re-hashed); 25 chunks "
                          "present, not re-read (deep=true re-hashes them)", "problems": []}


# -- objects -----------------------------------------------------------------------------------

class MissingRequest(BaseModel):
    keys: list[str] = Field(max_length=100_000, description="object keys to look for")


class Missing(Answer):
    missing: list[str] = Field(description="the keys the server lacks")
    example = {"missing": ["chunks/3f/" + ID]}


class ObjectPage(Answer):
    keys: list[str] = Field(description="in order, after `after`")
    more: bool = Field(description="the page is full: ask again from its last key")
    example = {"keys": ["chunks/3f/" + ID], "more": False}


class Stored(Answer):
    """A PUT's answer: ``stored`` for a plain PUT (200); ``created`` with ``?create=true``:
    true (201) or false when the object exists already (409)."""

    key: str
    stored: bool | None = Field(default=None, description="a plain PUT: true")
    created: bool | None = Field(default=None, description="?create=true: whether it was")
    example = {"key": f"jobs/vision/resnet50/manifests/{ID}.json", "created": True}


class ObjectDeleted(Answer):
    key: str
    deleted: bool
    example = {"key": "inflight/5d2c8e1f0a9b3c47", "deleted": True}


# -- operations --------------------------------------------------------------------------------

class Damage(Answer):
    key: str
    reason: str
    snapshot: str = Field(description="the snapshot it is or belongs to; empty if none")
    blocks: bool = Field(description="gc deleted nothing while it is there")
    movable: bool = Field(description="`ciuic gc --quarantine` moves it aside")


class GcAnswer(Answer):
    """``GcResult``'s fields."""

    deleted_chunks: int
    deleted_bodies: int
    deleted_bytes: int
    deleted_markers: int
    deleted_temporaries: int
    kept_chunks: int
    kept_for_damage: int = Field(description="kept only because a damaged manifest may "
                                 "reference them")
    skipped: str = Field(description="why gc did not run (another one runs); empty if it ran")
    damage: list[Damage]
    quarantined: list[str]
    example = {"deleted_chunks": 40, "deleted_bodies": 2, "deleted_bytes": 167772160,
               "deleted_markers": 0, "deleted_temporaries": 0, "kept_chunks": 512,
               "kept_for_damage": 0, "skipped": "", "damage": [], "quarantined": []}


class AuditEvent(Answer):
    id: int
    at: str = Field(description="ISO 8601 UTC")
    actor: str = Field(description="key:ID, or cli:USER@HOST")
    project: str
    action: str = Field(description="snapshot.save, snapshot.read, lease.take, snapshot.prune, "
                        "snapshot.delete, object.delete, object.delete.refused, gc, "
                        "apikey.create, apikey.revoke")
    target: str
    remote: str = Field(description="the client's address")
    example = {"id": 812, "at": AT, "actor": "key:4f1c2b3a9d8e", "project": "vision",
               "action": "snapshot.save", "target": f"resnet50 {ID}", "remote": "10.0.3.7"}


class AuditPage(Answer):
    events: list[AuditEvent] = Field(description="newest first")
    next: int | None = Field(description="the `before` of the next page; null on the last")
    example = {"events": [AuditEvent.example], "next": None}


#: the 200 of routes whose answer is not JSON
OCTETS = {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                               "format": "binary"}}},
          "description": "the object's bytes"}
METRICS_TEXT = {"content": {"text/plain": {"schema": {"type": "string"},
                                           "example": "ciuic_requests_total{method=\"GET\","
                                                      "route=\"/health\",status=\"200\"} 3.0\n"}},
                "description": "Prometheus text format"}
OCTETS_RANGE = {"content": {"application/octet-stream": {"schema": {"type": "string",
                                                                     "format": "binary"}}},
                "description": "the bytes of the range asked for with `Range: bytes=FIRST-LAST`"
                               " (at most 64 MiB; `Content-Range` says which came)"}
HTML = {"content": {"text/html": {"schema": {"type": "string"}}},
        "description": "the dashboard's page"}
