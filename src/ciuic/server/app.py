"""The ciuic server: a FastAPI app over any ciuic store (docs/server.md).

Each project is its own ciuic store, ``projects/<name>/`` inside the server's storage (so keys,
objects and deduplication never cross projects), indexed by the server's catalog, which also
holds the API keys and the audit log. Clients write exactly what the embedded default writes
(chunks, then the body, then the manifest create: the commit), through the object API; the
server checks every key and name, authorizes every call by the key's project and role, indexes
each committed manifest it can read, and records who saved, read and deleted what.
"""


import logging
import re
from dataclasses import asdict
from importlib import resources
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from ciuic.catalog.keys import AUDIT_PAGE, KeyInfo, audit, audit_log, authenticate
from ciuic.chain.gc import collect
from ciuic.chain.repo import Repository, list_jobs
from ciuic.chain.retention import prune_one
from ciuic.chain.runs import history
from ciuic.errors import (
    ApiError,
    CiuicError,
    ConfigurationError,
    InvalidKey,
    MissingKey,
    ObjectNotFound,
    SnapshotNotFound,
    StoreError,
    UnreadableObject,
    UnsupportedFormat,
)
from ciuic.faults import failpoint
from ciuic.format import layout
from ciuic.format.info import SnapshotInfo
from ciuic.format.records import RunReport as RunRecord  # RunReport: the request's model
from ciuic.server import inspect, policy, schemas
from ciuic.server.guard import DEFAULT_JSON_MAX_BYTES, Guard, key_of
from ciuic.server.observe import install
from ciuic.server.openapi import install_document
from ciuic.server.ranges import RANGE_MAX_BYTES, byte_range
from ciuic.store.base import check_prefix
from ciuic.version import __version__

log = logging.getLogger("ciuic.server")
_RUN_ID = re.compile(r"^[0-9a-f]{16}$")
DEFAULT_MAX_OBJECT_BYTES = 256 * 1024 * 1024
LIST_PAGE = 1000
GC_MAX_WAIT_S = 30.0  # the longest a gc asked through the API waits for saves in progress


class RunEventReport(BaseModel):
    at: str = Field(max_length=32)
    kind: str = Field(max_length=32)
    step: int | None = None
    detail: str = Field(default="", max_length=4000)


class RunReport(BaseModel):
    """A client's run of a job, as its own catalog holds it, and its events since the last
    report (``ciuic.manager.report``): what ``ciuic log`` and the dashboard say about runs.
    Safe to send again: an event the server has already is not added twice."""

    started: str = Field(max_length=32)
    host: str = Field(max_length=255)
    pid: int
    last_step: int | None = None
    last_seen: str = Field(max_length=32)
    ended: str | None = Field(default=None, max_length=32)
    end_kind: str | None = Field(default=None, max_length=64)
    cause: str | None = Field(default=None, max_length=2000)
    restart: int | None = None
    events: list[RunEventReport] = Field(default_factory=list, max_length=10_000)


def _newer(e: UnsupportedFormat) -> ApiError:
    """A snapshot written by a newer ciuic than the server's: intact, not damaged."""
    return ApiError(422, "newer_format", f"{e}: the snapshot was written by a newer ciuic than "
                    f"this server's ({__version__}); upgrade the server to read it")


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def create_app(location: str | None = None, catalog_url: str | None = None, *,
               max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
               json_max_bytes: int = DEFAULT_JSON_MAX_BYTES,
               layout_keys_only: bool = True) -> FastAPI:
    """The app serving the store at ``location`` (a directory or URL; default ``$CIUIC_HOME``
    or ``./.ciuic``) with the catalog at ``catalog_url`` (default: the store's). Request
    bodies other than object uploads are capped at ``json_max_bytes``. ``layout_keys_only``
    False lets any well-formed object key through (a test server for the Store contract,
    whose keys are not ciuic's; ``ciuic serve`` never does)."""
    root = Repository.open(location, catalog_url)
    catalog = root.catalog
    repos: dict[str, Repository] = {}

    def repo_of(project: str) -> Repository:
        if project not in repos:
            repos[project] = root.served(project)
        return repos[project]

    app = FastAPI(title="ciuic", version=__version__,
                  description="The ciuic snapshot server: projects, jobs, snapshot chains and "
                              "their content-addressed objects. Authenticate with "
                              "`Authorization: Bearer <API key>`.")
    app.state.root = root
    app.add_middleware(Guard, catalog=catalog, json_max_bytes=json_max_bytes,
                       routes=app.router.routes)  # inside the metrics: refusals are counted
    metrics = install(app)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.code, e.message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return _error(e.status_code, code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return _error(400, "invalid_request", f"{where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(CiuicError)
    async def ciuic_error(_: Request, e: CiuicError) -> JSONResponse:
        if isinstance(e, (InvalidKey, ConfigurationError)):
            return _error(400, "invalid_name", str(e))
        if isinstance(e, (ObjectNotFound, SnapshotNotFound)):
            return _error(404, "not_found", str(e))
        if isinstance(e, StoreError):
            log.error("storage error: %s", e)
            return _error(503, "storage_unavailable", f"the server's storage failed: {e}")
        return _error(500, "internal", str(e))

    def caller(request: Request) -> KeyInfo:
        """The request's key, as ciuic.server.guard checked it before the body was read."""
        info = getattr(request.state, "key", None)
        if info is None:  # pragma: no cover - every route with a key passes the guard
            info = authenticate(catalog, key_of(dict(request.headers)))
            if info is None:
                raise ApiError(401, "invalid_key", "the API key is unknown, revoked or expired")
        return info

    Caller = Annotated[KeyInfo, Depends(caller)]

    def allow(info: KeyInfo, project: str, role: str) -> None:
        layout.check_name("project", project)
        if info.project != project:
            raise ApiError(403, "wrong_project", f"this key belongs to project "
                           f"{info.project!r}, not {project!r}")
        if not info.allows(role):
            raise ApiError(403, "forbidden", f"this needs the {role} role; the key is a "
                           f"{info.role}")

    def object_key(project: str, key: str) -> str:
        policy.object_kind(project, key, layout_keys_only)
        return key

    # -- health and identity ------------------------------------------------------------------

    @app.get("/", tags=["dashboard"], response_class=HTMLResponse, responses={200: schemas.HTML})
    def dashboard() -> HTMLResponse:
        """The dashboard: projects -> jobs -> the chain -> a snapshot (static page, API calls
        with the key the user enters; it never leaves the browser tab)."""
        page = resources.files("ciuic.server").joinpath("dashboard.html").read_text("utf-8")
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/health", tags=["operations"], **answer(schemas.Health))
    def health() -> dict[str, Any]:
        """Liveness and version (no key)."""
        return {"status": "ok", "version": __version__}

    @app.get("/v1/whoami", tags=["auth"], **answer(schemas.WhoAmI, 401))
    def whoami(info: Caller) -> dict[str, Any]:
        """The key's project and role."""
        return {"key": info.id, "project": info.project, "role": info.role}

    # -- projects, jobs, snapshots ------------------------------------------------------------

    @app.get("/v1/projects", tags=["snapshots"], **answer(schemas.Projects, 401))
    def projects(info: Caller) -> dict[str, Any]:
        """The projects the key opens: its own."""
        return {"projects": [info.project]}

    @app.get("/v1/projects/{project}/jobs", tags=["snapshots"],
             **answer(schemas.Jobs, *schemas.PROJECT))
    def jobs(info: Caller, project: str) -> dict[str, Any]:
        """The project's jobs with their snapshot counts (reader)."""
        allow(info, project, "reader")
        for _, job in list_jobs(repo_of(project).store, project):
            repo_of(project).sync_job(project, job)
        return {"jobs": [j.to_json() for j in catalog.jobs() if j.project == project]}

    @app.get("/v1/projects/{project}/jobs/{job}/snapshots", tags=["snapshots"],
             **answer(schemas.SnapshotPage, *schemas.PROJECT))
    def snapshots(info: Caller, project: str, job: str,
                  limit: Annotated[int, Query(ge=1, le=1000)] = 50,
                  offset: Annotated[int, Query(ge=0)] = 0) -> dict[str, Any]:
        """The job's chain, newest first, a page at a time (reader); each snapshot's
        ``notes``: where runs stopped after it and why, who resumed from it."""
        allow(info, project, "reader")
        layout.check_name("job", job)
        repo_of(project).sync_job(project, job)
        every = catalog.snapshots(project, job, status=None, newest_first=True)
        found = [s for s in every if s.status == "committed"]
        # where runs were interrupted after each snapshot and why (on a listed snapshot, where
        # retention pruned the ones before it), and who resumed from it
        notes = history(catalog.runs(project, job), catalog.events(project, job, limit=100_000),
                        every)
        return {"total": len(found), "offset": offset, "limit": limit,
                "snapshots": [{**s.to_json(), "notes": notes.get(s.id, [])}
                              for s in found[offset:offset + limit]]}

    @app.put("/v1/projects/{project}/jobs/{job}/runs/{run_id}", tags=["snapshots"],
             **answer(schemas.RunAnswer, *schemas.PROJECT, 413, 422))
    def report_run(info: Caller, project: str, job: str, run_id: str,
                   report: RunReport) -> dict[str, Any]:
        """A client's run of the job and its new events (writer; ``manager/report.py``)."""
        allow(info, project, "writer")
        layout.check_name("job", job)
        if not _RUN_ID.match(run_id):
            raise ApiError(422, "invalid_run", "a run ID is 16 hexadecimal characters")
        added = catalog.record_run(project, job, run_id,
                                   RunRecord.from_json(run_id, report.model_dump()))
        # "events": those the report carried; "added": those the server did not have yet
        return {"run": run_id, "events": len(report.events), "added": added}

    @app.get("/v1/projects/{project}/jobs/{job}/snapshots/latest", tags=["snapshots"],
             **answer(schemas.Snapshot, *schemas.PROJECT, 404))
    def latest(info: Caller, project: str, job: str) -> dict[str, Any]:
        """The job's newest snapshot (reader)."""
        allow(info, project, "reader")
        layout.check_name("job", job)
        repo_of(project).sync_job(project, job)
        found = catalog.latest(project, job)
        if found is None:
            raise ApiError(404, "not_found", f"job {project}/{job} has no snapshot")
        return found.to_json()

    @app.get("/v1/projects/{project}/snapshots/{snapshot_id}", tags=["snapshots"],
             **answer(schemas.Snapshot, *schemas.PROJECT, 404))
    def snapshot(info: Caller, project: str, snapshot_id: str
                 ) -> dict[str, Any]:
        """One snapshot by ID or unique ID prefix (reader)."""
        allow(info, project, "reader")
        found: SnapshotInfo = _resolve(project, snapshot_id)
        return found.to_json()

    @app.delete("/v1/projects/{project}/snapshots/{snapshot_id}", tags=["snapshots"],
                **answer(schemas.Deleted, *schemas.PROJECT, 404))
    def delete_snapshot(info: Caller, project: str, snapshot_id: str,
                        request: Request) -> dict[str, Any]:
        """Prune a snapshot: its body deleted, its manifest kept in the chain (admin)."""
        allow(info, project, "admin")
        found = _resolve(project, snapshot_id)
        prune_one(repo_of(project), found)
        audit(catalog, f"key:{info.id}", project, "snapshot.delete",
              f"{found.job}@{found.step} {found.id}", _remote(request))
        return {"deleted": found.id, "status": "pruned"}

    @app.get("/v1/projects/{project}/snapshots/{snapshot_id}/tensors", tags=["snapshots"],
             **answer(schemas.Tensors, *schemas.PROJECT, 404, 410, 422, 429))
    def snapshot_tensors(info: Caller, project: str, snapshot_id: str) -> dict[str, Any]:
        """Every tensor of a snapshot with its statistics (reader): as recorded, else computed
        for snapshots up to 512 MB; one such read per key at a time, 4 in all (429)."""
        allow(info, project, "reader")
        found = _resolve(project, snapshot_id)
        if found.status != "committed":
            raise _gone(found)
        try:
            return inspect.tensors(repo_of(project), found, info.id)
        except MissingKey as e:
            raise ApiError(422, "encrypted", f"snapshot {found.short_id} is encrypted; only "
                           f"clients holding the key can read it ({e})") from e
        except UnsupportedFormat as e:
            raise _newer(e) from e
        except UnreadableObject as e:
            if _body_gone(project, found):
                raise _gone(found) from e
            raise ApiError(422, "damaged", f"snapshot {found.short_id} is damaged: {e}; "
                           "`ciuic verify --deep` names every damaged object") from e

    @app.get("/v1/projects/{project}/jobs/{job}/series", tags=["snapshots"],
             **answer(schemas.Series, *schemas.PROJECT))
    def job_series(info: Caller, project: str, job: str) -> dict[str, Any]:
        """The loss and each state's L2 norm at every snapshot, with its health (no tensor
        is read: the manifests record them)."""
        allow(info, project, "reader")
        layout.check_name("job", job)
        repo_of(project).sync_job(project, job)
        return inspect.series(repo_of(project), project, job)

    @app.get("/v1/projects/{project}/diff", tags=["snapshots"],
             **answer(schemas.Diff, *schemas.PROJECT, 404, 410, 422, 429))
    def snapshot_diff(info: Caller, project: str, a: str, b: str) -> dict[str, Any]:
        """``ciuic diff A B`` of two snapshots of the project (IDs or ID prefixes)."""
        allow(info, project, "reader")
        found_a, found_b = _resolve(project, a), _resolve(project, b)
        for found in (found_a, found_b):
            if found.status != "committed":
                raise _gone(found)
        try:
            return inspect.compare(repo_of(project), found_a, found_b, info.id)
        except MissingKey as e:
            raise ApiError(422, "encrypted", f"the snapshots are encrypted; only clients "
                           f"holding the key can compare them ({e})") from e
        except UnsupportedFormat as e:
            raise _newer(e) from e
        except UnreadableObject as e:
            raise ApiError(422, "damaged", f"a snapshot is damaged: {e}; `ciuic verify "
                           "--deep` names every damaged object") from e

    def _body_gone(project: str, found: SnapshotInfo) -> bool:
        """Whether a snapshot's body was deleted (by any client); then the catalog says so."""
        if repo_of(project).store.has(layout.body_key(found.project, found.job, found.body)):
            return False
        catalog.set_status(found.id, "pruned")
        return True

    def _gone(found: SnapshotInfo) -> ApiError:
        return ApiError(410, "pruned", f"snapshot {found.short_id} was pruned: its tensors are "
                        "gone (the manifest stays in the chain)")

    @app.post("/v1/projects/{project}/snapshots/{snapshot_id}/verify", tags=["snapshots"],
              **answer(schemas.Verified, *schemas.PROJECT, 404, 429))
    def snapshot_verify(info: Caller, project: str, snapshot_id: str,
                        deep: bool = False) -> dict[str, Any]:
        """Check a snapshot: its manifest, parent link and body (re-hashed) and its chunks
        present; ``deep``: every chunk re-read and re-hashed, one deep check at a time (429)."""
        allow(info, project, "reader")  # a read; deep checks run one at a time (inspect.verify)
        found = _resolve(project, snapshot_id)
        if found.status == "committed":
            _body_gone(project, found)
        return inspect.verify(repo_of(project), catalog.get(found.id), deep)

    def _resolve(project: str, snapshot_id: str) -> Any:
        if not re.fullmatch(r"[0-9a-f]{4,64}", snapshot_id):
            raise ApiError(400, "invalid_name", f"{snapshot_id!r} is not a snapshot ID (hex)")
        found = (catalog.get(snapshot_id) if len(snapshot_id) == 64
                 else catalog.find_prefix(snapshot_id, project))  # never another project's
        if found.project != project:
            raise SnapshotNotFound(f"no snapshot {snapshot_id} in project {project}")
        return found

    # -- objects ------------------------------------------------------------------------------

    @app.post("/v1/projects/{project}/objects/missing", tags=["objects"],
              **answer(schemas.Missing, *schemas.PROJECT, 413))
    def missing(info: Caller, project: str, req: schemas.MissingRequest) -> dict[str, Any]:
        """Which of these object keys the server lacks (writer)."""
        allow(info, project, "writer")
        store = repo_of(project).store
        return {"missing": [k for k in req.keys if not store.has(object_key(project, k))]}

    @app.get("/v1/projects/{project}/objects", tags=["objects"],
             **answer(schemas.ObjectPage, *schemas.PROJECT))
    def list_objects(info: Caller, project: str, prefix: str = "", after: str = "",
                     limit: Annotated[int, Query(ge=1, le=LIST_PAGE)] = LIST_PAGE
                     ) -> dict[str, Any]:
        """The object keys under ``prefix``, in order, after ``after`` (reader; not
        ``inflight/``)."""
        allow(info, project, "reader")
        check_prefix(prefix)
        keys: list[str] = []
        for k in repo_of(project).store.list(prefix):
            if k > after and not k.startswith(layout.INFLIGHT):  # saves' markers: gc's own
                keys.append(k)
                if len(keys) == limit:
                    break
        return {"keys": keys, "more": len(keys) == limit}

    @app.put("/v1/projects/{project}/objects/{key:path}", tags=["objects"], status_code=200,
             **answer(schemas.Stored, *schemas.PROJECT, 413, created=(
                 201, "created (`?create=true`): the commit of a manifest"), exists=(
                 409, "not created (`?create=true`): the object exists already")),
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string",
                                                         "format": "binary"}}}}})
    async def put_object(info: Caller, project: str, key: str, request: Request,
                         response: Response, create: bool = False) -> dict[str, Any]:
        """Upload an object, the request's body as its bytes (writer; only the layout's keys,
        by kind: docs/server.md, "Authorization"). ``create``: only if it does not exist."""
        allow(info, project, "writer")
        kind = policy.object_kind(project, key, layout_keys_only)
        policy.check_put(kind, create)
        declared = request.headers.get("content-length")
        if declared is not None and not declared.isdigit():
            raise ApiError(400, "invalid_request", "Content-Length must be a number of bytes")
        if declared is not None and int(declared) > max_object_bytes:
            raise ApiError(413, "too_large", f"objects are limited to {max_object_bytes} bytes")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > max_object_bytes:
                raise ApiError(413, "too_large",
                               f"objects are limited to {max_object_bytes} bytes")
        store = repo_of(project).store
        metrics.bytes.labels("in").inc(len(body))
        await run_in_threadpool(failpoint, "server.put")  # tests: a slow store
        m = layout.parse_manifest(key)
        if not create:
            if kind in ("chunk", "pack", "body"):  # never rewritten: the first copy stays
                await run_in_threadpool(store.create, key, bytes(body))
            else:
                await run_in_threadpool(store.put, key, bytes(body))
            return {"key": key, "stored": True}
        data: bytes | None = bytes(body)
        if kind == "lease":  # the job's next token only; the server notes whose key took it
            data = await run_in_threadpool(policy.new_lease, store, key, bytes(body), info)
        created = data is not None and await run_in_threadpool(store.create, key, data)
        if not created:
            response.status_code = 409
            return {"key": key, "created": False}
        response.status_code = 201
        if m is not None or kind == "lease":  # record who saved or took it; that cannot undo it
            done = ("snapshot.save", f"{m.job} {m.snapshot_id}") if m else ("lease.take", key)
            try:
                await run_in_threadpool(audit, catalog, f"key:{info.id}", project, *done,
                                        _remote(request))
            except Exception as e:
                log.error("could not audit the creation of %s: %s", key, e)
        if m is not None:  # committed: index it
            metrics.snapshots.labels(project).inc()
            await run_in_threadpool(_index, project, m.job)
        return {"key": key, "created": True}

    def _index(project: str, job: str) -> None:
        try:
            repo_of(project).sync_job(project, job)
        except Exception as e:  # unreadable (sealed) or a busy catalog: listings index lazily
            log.info("not indexing %s/%s now: %s", project, job, e)

    @app.get("/v1/projects/{project}/objects/{key:path}", tags=["objects"],
             response_class=Response,
             responses={200: schemas.OCTETS, 206: schemas.OCTETS_RANGE,
                        **schemas.errors(*schemas.PROJECT, 404, 416)})
    def get_object(info: Caller, project: str, key: str, request: Request) -> Response:
        """An object's bytes (reader); with ``Range: bytes=FIRST-LAST`` (or ``FIRST-``) only
        those, 206, at most 64 MiB of them per request (``Content-Range`` says which)."""
        allow(info, project, "reader")
        key = object_key(project, key)
        store = repo_of(project).store
        span = byte_range(request.headers.get("range"))
        m = layout.parse_manifest(key)
        if m is not None:
            audit(catalog, f"key:{info.id}", project, "snapshot.read",
                  f"{m.job} {m.snapshot_id}", _remote(request))
        if span is None:
            data = store.get(key)
            metrics.bytes.labels("out").inc(len(data))
            return Response(data, media_type="application/octet-stream")
        first, last = span
        buf = bytearray(min(RANGE_MAX_BYTES, (last if last is not None else first
                                              + RANGE_MAX_BYTES - 1) - first + 1))
        size = store.get_into(key, [memoryview(buf)], first)
        if first >= size:
            answer = _error(416, "range_past_end", f"the range starts at byte {first}, at or "
                            f"past the end of {key} ({size} bytes)")
            answer.headers["Content-Range"] = f"bytes */{size}"
            return answer
        n = min(len(buf), size - first)
        metrics.bytes.labels("out").inc(n)
        return Response(bytes(buf[:n]), status_code=206, media_type="application/octet-stream",
                        headers={"Content-Range": f"bytes {first}-{first + n - 1}/{size}"})

    @app.head("/v1/projects/{project}/objects/{key:path}", tags=["objects"],
              response_class=Response, responses={
                  200: {"description": "the object exists (no body)"},
                  **schemas.bare(*schemas.PROJECT, 404)})
    def head_object(info: Caller, project: str, key: str) -> Response:
        """Whether an object exists (reader)."""
        allow(info, project, "reader")
        key = object_key(project, key)
        if not repo_of(project).store.has(key):
            return Response(status_code=404)
        return Response(status_code=200)

    @app.delete("/v1/projects/{project}/objects/{key:path}", tags=["objects"],
                **answer(schemas.ObjectDeleted, *schemas.PROJECT))
    def delete_object(info: Caller, project: str, key: str, request: Request) -> dict[str, Any]:
        """Delete an object, by kind (writer: docs/server.md, "Authorization"); a deleted body
        marks its snapshots pruned."""
        allow(info, project, "writer")
        kind = policy.object_kind(project, key, layout_keys_only)
        store, actor = repo_of(project).store, f"key:{info.id}"
        refused = policy.delete_refusal(store, kind, key, info)
        if refused is not None:  # an attempt is audited too
            audit(catalog, actor, project, "object.delete.refused", key, _remote(request))
            raise ApiError(403, "forbidden", refused)
        store.delete(key)
        body = layout.parse_body(key)
        if body is not None:  # retention or an admin: the server's catalog follows at once
            for snap in catalog.snapshots(body[0], body[1]):
                if snap.body == body[2]:
                    catalog.set_status(snap.id, "pruned")
        audit(catalog, actor, project, "snapshot.prune" if body else "object.delete", key,
              _remote(request))
        return {"key": key, "deleted": True}

    # -- the server's gc and the audit log ----------------------------------------------------

    @app.post("/v1/projects/{project}/gc", tags=["operations"],
              **answer(schemas.GcAnswer, *schemas.PROJECT))
    def garbage_collect(info: Caller, project: str, request: Request, dry_run: bool = False,
                        wait_s: Annotated[float, Query(ge=0, le=GC_MAX_WAIT_S)] = 0.0
                        ) -> dict[str, Any]:
        """``ciuic gc`` of the project, run by the server: the only way chunks are deleted
        (it keeps every chunk and body a snapshot references). A writer's retention asks for
        it; one gc at a time per project (another answers ``skipped``)."""
        allow(info, project, "writer")
        result = collect(repo_of(project), dry_run=dry_run, wait_s=wait_s)
        if not dry_run:
            skipped = f"; skipped: {result.skipped}" if result.skipped else ""
            audit(catalog, f"key:{info.id}", project, "gc", f"{result.deleted_chunks} chunks, "
                  f"{result.deleted_bodies} bodies deleted{skipped}", _remote(request))
        return asdict(result)

    @app.get("/v1/projects/{project}/audit", tags=["operations"],
             **answer(schemas.AuditPage, *schemas.PROJECT))
    def read_audit(info: Caller, project: str,
                   key: Annotated[str | None, Query(max_length=64)] = None,
                   action: Annotated[str | None, Query(max_length=64)] = None,
                   since: Annotated[str | None, Query(max_length=64)] = None,
                   until: Annotated[str | None, Query(max_length=64)] = None,
                   limit: Annotated[int, Query(ge=1, le=AUDIT_PAGE)] = 100,
                   before: Annotated[int | None, Query(ge=1)] = None) -> dict[str, Any]:
        """The project's audit log, newest first (admin): by key id, action and time
        (``since`` inclusive, ``until`` exclusive; ISO 8601, UTC unless said). ``next``: the
        ``before`` of the next page, null on the last."""
        allow(info, project, "admin")
        events = audit_log(catalog, project, limit, key=key, action=action, since=since,
                           until=until, before=before)
        return {"events": events, "next": events[-1]["id"] if len(events) == limit else None}

    install_document(app)
    return app


def answer(model: type[schemas.Answer], *statuses: int, **more: tuple[int, str]) -> dict[str, Any]:
    """A JSON route's documentation: its answer ``model`` (the route's dict is checked against
    it and sent as it is: ``schemas``' docstring), the error statuses it answers (each an
    :class:`~ciuic.server.schemas.ErrorBody`) and ``more`` successful statuses (status,
    description) answered with the same model."""
    responses: dict[int | str, dict[str, Any]] = schemas.errors(*statuses)
    for status, description in more.values():
        responses[status] = {"model": model, "description": description}
    return {"response_model": model, "response_model_exclude_unset": True,
            "responses": responses}


def _remote(request: Request) -> str:
    return request.client.host if request.client else ""
