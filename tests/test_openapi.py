"""The server's OpenAPI document (issue 48): every route has its answer documented (a response
model, or the content type of a route that is not JSON) and its errors as the one error body;
real answers, success and error, match what the document says of their route and status,
key for key; ``ciuic serve --openapi`` prints the whole document."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from ciuic.catalog.keys import create_key
from ciuic.chain.repo import Repository
from ciuic.server import create_app, schemas
from tests.serverutil import cli
from tests.test_server import _save_through, chunk, mlp

ERROR_REF = "#/components/schemas/ErrorBody"
#: the one 4xx that is an answer, not a refusal: a create that found the object (HttpStore.create)
NOT_ERRORS = {("/v1/projects/{project}/objects/{key}", "put", "409")}


def _document(app: Any) -> dict[str, Any]:
    with TestClient(app) as http:
        r = http.get("/openapi.json")
    assert r.status_code == 200
    return dict(r.json())


def test_every_route_documents_its_answer_and_its_errors(tmp_path: Path) -> None:
    app = create_app(str(tmp_path / "store"))
    routes = [r for r in app.routes if isinstance(r, APIRoute)]
    assert len(routes) >= 22
    doc = _document(app)
    components = doc["components"]["schemas"]
    for route in routes:
        assert route.include_in_schema, route.path
        for method in route.methods:
            op = doc["paths"][route.path_format][method.lower()]
            answers = op["responses"]
            assert "200" in answers, (method, route.path)
            if route.response_model is not None:  # a JSON answer: one of the models, exemplified
                assert issubclass(route.response_model, schemas.Answer), route.path
                ref = answers["200"]["content"]["application/json"]["schema"]["$ref"]
                assert ref == f"#/components/schemas/{route.response_model.__name__}"
                examples = components[route.response_model.__name__]["examples"]
                for example in examples:
                    route.response_model.model_validate(example)
            elif method == "HEAD":
                assert "content" not in answers["200"], route.path
            else:  # bytes, text or HTML: its content type documented
                content = answers["200"]["content"]
                assert list(content) and "application/json" not in content, route.path
            errors = [s for s in answers if s >= "400"
                      and (route.path_format, method.lower(), s) not in NOT_ERRORS]
            if route.path.startswith("/v1/") or route.path == "/metrics":
                assert "401" in errors, (method, route.path)  # the key is checked first
            for status in errors:
                if method == "HEAD":  # HEAD answers carry no body
                    assert "content" not in answers[status], (route.path, status)
                    continue
                schema = answers[status]["content"]["application/json"]["schema"]
                assert schema == {"$ref": ERROR_REF}, (method, route.path, status)
                assert answers[status]["description"], (method, route.path, status)
    # FastAPI's own 422 body is never answered (a request that does not validate is a 400)
    assert "HTTPValidationError" not in json.dumps(doc)
    assert set(components["ErrorBody"]["properties"]) == {"error"}


@pytest.fixture()
def api(tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str], str]]:
    store = tmp_path / "store"
    repo = Repository.open(store)
    keys = {role: create_key(repo.catalog, "p", role)[0] for role in ("reader", "writer",
                                                                         "admin")}
    keys["foreign"] = create_key(repo.catalog, "q", "admin")[0]
    repo.close()
    with TestClient(create_app(str(store), json_max_bytes=4096)) as http:
        yield http, keys, str(store)


def _walk(value: Any, schema: dict[str, Any], components: dict[str, Any], where: str
          ) -> list[str]:
    """How ``value`` departs from ``schema``: a type other than the schema's, a required key
    missing, or a key the schema does not declare (unless it leaves the object open)."""
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[1]]
    if "anyOf" in schema:
        tries = [_walk(value, s, components, where) for s in schema["anyOf"]]
        return min(tries, key=len)
    kind = schema.get("type")
    if kind is None:  # Any
        return []
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
             "integer": int, "number": (int, float)}
    if not isinstance(value, types[kind]) or (kind in ("integer", "number")
                                               and isinstance(value, bool)):
        return [f"{where}: {value!r} is not {kind}"]
    if kind == "array":
        return [p for i, v in enumerate(value)
                for p in _walk(v, schema.get("items", {}), components, f"{where}[{i}]")]
    if kind != "object":
        return []
    found = [f"{where}.{k}: required, missing" for k in schema.get("required", [])
             if k not in value]
    for k, v in value.items():
        if k in schema.get("properties", {}):
            found += _walk(v, schema["properties"][k], components, f"{where}.{k}")
        elif isinstance(schema.get("additionalProperties"), dict):
            found += _walk(v, schema["additionalProperties"], components, f"{where}.{k}")
        elif not schema.get("additionalProperties"):
            found.append(f"{where}.{k}: not in the document")
    return found


def test_real_answers_are_what_the_document_says(
        api: tuple[TestClient, dict[str, str], str]) -> None:
    """Every route called with real data (two snapshots saved through the API), to a success
    and to the errors it can be brought to here: each status is documented for its route,
    and each JSON body matches that status's schema, with no key the document lacks."""
    http, keys, store = api
    model, _ = mlp()
    first = _save_through(http, keys["writer"], store, model)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    second = _save_through(http, keys["writer"], store, model)
    manifest = f"jobs/p/default/manifests/{second}.json"
    raw_manifest = http.get(f"/v1/projects/p/objects/{manifest}",
                            headers={"Authorization": f"Bearer {keys['reader']}"}).content
    P = "/v1/projects/{project}"
    OBJ = P + "/objects/{key}"
    calls: list[tuple[str, str, str, str | None, dict[str, Any], int]] = [
        # method, template, path, key role, request kwargs, the status expected
        ("GET", "/health", "/health", None, {}, 200),
        ("GET", "/", "/", None, {}, 200),
        ("GET", "/metrics", "/metrics", "reader", {}, 200),
        ("GET", "/metrics", "/metrics", None, {}, 401),
        ("GET", "/v1/whoami", "/v1/whoami", "writer", {}, 200),
        ("GET", "/v1/whoami", "/v1/whoami", None, {}, 401),
        ("GET", "/v1/projects", "/v1/projects", "reader", {}, 200),
        ("GET", P + "/jobs", "/v1/projects/p/jobs", "reader", {}, 200),
        ("GET", P + "/jobs", "/v1/projects/q/jobs", "reader", {}, 403),
        ("GET", P + "/jobs", "/v1/projects/_bad/jobs", "reader", {}, 400),
        ("GET", P + "/jobs/{job}/snapshots", "/v1/projects/p/jobs/default/snapshots",
         "reader", {}, 200),
        ("GET", P + "/jobs/{job}/snapshots", "/v1/projects/p/jobs/default/snapshots",
         "reader", {"params": {"limit": 0}}, 400),
        ("GET", P + "/jobs/{job}/snapshots/latest",
         "/v1/projects/p/jobs/default/snapshots/latest", "reader", {}, 200),
        ("GET", P + "/jobs/{job}/snapshots/latest", "/v1/projects/p/jobs/none/snapshots/latest",
         "reader", {}, 404),
        ("GET", P + "/snapshots/{snapshot_id}", f"/v1/projects/p/snapshots/{second[:12]}",
         "reader", {}, 200),
        ("GET", P + "/snapshots/{snapshot_id}", "/v1/projects/p/snapshots/ffffffff",
         "reader", {}, 404),
        ("GET", P + "/snapshots/{snapshot_id}/tensors",
         f"/v1/projects/p/snapshots/{second}/tensors", "reader", {}, 200),
        ("GET", P + "/jobs/{job}/series", "/v1/projects/p/jobs/default/series", "reader", {},
         200),
        ("GET", P + "/diff", "/v1/projects/p/diff", "reader",
         {"params": {"a": first, "b": second}}, 200),
        ("POST", P + "/snapshots/{snapshot_id}/verify",
         f"/v1/projects/p/snapshots/{second}/verify", "reader", {"params": {"deep": "true"}},
         200),
        ("PUT", P + "/jobs/{job}/runs/{run_id}", "/v1/projects/p/jobs/default/runs/"
         "0123456789abcdef", "writer", {"json": {
             "started": "2026-12-05T11:00:00Z", "host": "h", "pid": 7,
             "last_seen": "2026-12-05T11:30:00Z", "events": [
                 {"at": "2026-12-05T11:00:00Z", "kind": "start"}]}}, 200),
        ("PUT", P + "/jobs/{job}/runs/{run_id}", "/v1/projects/p/jobs/default/runs/nothex",
         "writer", {"json": {"started": "x", "host": "h", "pid": 7, "last_seen": "x"}}, 422),
        ("PUT", P + "/jobs/{job}/runs/{run_id}", "/v1/projects/p/jobs/default/runs/"
         "0123456789abcdef", "writer", {"json": {"started": 1}}, 400),
        ("POST", P + "/objects/missing", "/v1/projects/p/objects/missing", "writer",
         {"json": {"keys": [chunk("aa")]}}, 200),
        ("POST", P + "/objects/missing", "/v1/projects/p/objects/missing", "reader",
         {"json": {"keys": [chunk("aa")]}}, 403),
        ("POST", P + "/objects/missing", "/v1/projects/p/objects/missing", "writer",
         {"json": {"keys": [chunk("aa")] * 100}}, 413),
        ("GET", P + "/objects", "/v1/projects/p/objects", "reader",
         {"params": {"prefix": "jobs/"}}, 200),
        ("PUT", OBJ, f"/v1/projects/p/objects/{chunk('aa')}", "writer", {"content": b"x"}, 200),
        ("PUT", OBJ, "/v1/projects/p/objects/keys/passphrase-salt", "writer",
         {"content": b"salt", "params": {"create": "true"}}, 201),
        ("PUT", OBJ, "/v1/projects/p/objects/keys/passphrase-salt", "writer",
         {"content": b"salt", "params": {"create": "true"}}, 409),
        ("PUT", OBJ, f"/v1/projects/p/objects/{manifest}", "writer",
         {"content": raw_manifest}, 403),
        ("PUT", OBJ, "/v1/projects/p/objects/not/a/ciuic/key", "writer", {"content": b"x"}, 400),
        ("GET", OBJ, f"/v1/projects/p/objects/{manifest}", "reader", {}, 200),
        ("GET", OBJ, f"/v1/projects/p/objects/{chunk('bb')}", "reader", {}, 404),
        ("HEAD", OBJ, f"/v1/projects/p/objects/{manifest}", "reader", {}, 200),
        ("HEAD", OBJ, f"/v1/projects/p/objects/{chunk('bb')}", "reader", {}, 404),
        ("PUT", OBJ, "/v1/projects/p/objects/inflight/marker", "writer", {"content": b"x"}, 200),
        ("DELETE", OBJ, "/v1/projects/p/objects/inflight/marker", "writer", {}, 200),
        ("DELETE", OBJ, f"/v1/projects/p/objects/{chunk('aa')}", "writer", {}, 403),
        ("POST", P + "/gc", "/v1/projects/p/gc", "writer", {"params": {"dry_run": "true"}}, 200),
        ("GET", P + "/audit", "/v1/projects/p/audit", "admin", {}, 200),
        ("GET", P + "/audit", "/v1/projects/p/audit", "admin", {"params": {"since": "x"}}, 400),
        ("GET", P + "/audit", "/v1/projects/p/audit", "writer", {}, 403),
        ("DELETE", P + "/snapshots/{snapshot_id}", f"/v1/projects/p/snapshots/{first}",
         "admin", {}, 200),
        ("GET", P + "/snapshots/{snapshot_id}/tensors",  # now pruned
         f"/v1/projects/p/snapshots/{first}/tensors", "reader", {}, 410),
        ("GET", P + "/diff", "/v1/projects/p/diff", "reader",
         {"params": {"a": first, "b": second}}, 410),
        ("GET", P + "/diff", "/v1/projects/p/diff", "foreign",
         {"params": {"a": first, "b": second}}, 403),
    ]
    doc = _document(http.app)
    components = doc["components"]["schemas"]
    called: set[tuple[str, str]] = set()
    for method, template, path, role, kwargs, expected in calls:
        headers = {"Authorization": f"Bearer {keys[role]}"} if role else {}
        r = http.request(method, path, headers=headers, **kwargs)
        assert r.status_code == expected, (method, path, r.status_code, r.text[:300])
        answers = doc["paths"][template][method.lower()]["responses"]
        assert str(r.status_code) in answers, (method, template, r.status_code)
        called.add((template, method.lower()))
        documented = answers[str(r.status_code)].get("content", {})
        if method == "HEAD":
            assert not documented and not r.content
            continue
        kind = r.headers["content-type"].split(";")[0]
        assert kind in documented, (method, template, r.status_code, kind, list(documented))
        if kind == "application/json":
            off = _walk(r.json(), documented[kind]["schema"], components, "answer")
            assert not off, (method, path, r.status_code, off)
    every = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert every == called, sorted(every - called)  # each documented operation was called


def test_serve_openapi_prints_the_whole_document(tmp_path: Path) -> None:
    store = tmp_path / "never-made"
    run = cli(store, "serve", "--openapi")
    assert run.returncode == 0, run.stderr
    printed = json.loads(run.stdout)
    assert not store.exists()  # the document needs no store: none was created
    assert printed == _document(create_app(str(tmp_path / "store")))
    app = create_app(str(tmp_path / "other"))
    routes = {(r.path_format, m.lower()) for r in app.routes if isinstance(r, APIRoute)
              for m in r.methods}
    assert routes == {(p, m) for p, ops in printed["paths"].items() for m in ops}
    assert printed["info"]["title"] == "ciuic" and printed["components"]["schemas"]["ErrorBody"]
