"""Property-based fuzz of the server's API, driven by its own OpenAPI schema: whatever the path
parameters, query values, bodies and keys, the server never answers 5xx, and every 4xx is a
JSON error with a code and a message. ``CIUIC_FUZZ_EXAMPLES=5000 pytest
tests/test_server_fuzz.py`` runs a longer, random campaign."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ciuic.catalog.keys import create_key
from ciuic.chain.repo import Repository
from ciuic.server import create_app

NASTY = st.sampled_from(["..", ".", "%2e%2e", "a/../b", "", " ", "-", "x" * 300, "é", "\x00",
                         "jobs", "chunks/aa", "p", "default", "0" * 64, "$x", "a//b",
                         # keys of the layout's shapes: the server's policy for each kind
                         "chunks/aa/" + "aa" * 32, "jobs/p/default/leases/000000000001.json",
                         "jobs/p/default/bodies/" + "b" * 64 + ".json", "locks/gc.json",
                         "inflight/x.json"])
TEXT = st.one_of(NASTY, st.text(min_size=0, max_size=40))
SCALAR = st.one_of(TEXT, st.integers(-2**70, 2**70), st.booleans(), st.floats(allow_nan=True),
                   st.none())


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, list[str],
                                                                      dict[str, Any]]]:
    store = tmp_path_factory.mktemp("fuzz") / "store"
    repo = Repository.open(store)
    keys = [create_key(repo.catalog, "p", role)[0] for role in ("reader", "writer", "admin")]
    keys.append(create_key(repo.catalog, "q", "admin")[0])
    repo.close()
    with TestClient(create_app(str(store), max_object_bytes=4096),
                    raise_server_exceptions=False) as http:
        yield http, keys, http.get("/openapi.json").json()


def operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method.upper(), op) for path, ops in schema["paths"].items()
            for method, op in ops.items() if method in ("get", "put", "post", "delete", "head")]


@st.composite
def requests(draw: st.DrawFn, schema: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    path, method, op = draw(st.sampled_from(operations(schema)))
    params: dict[str, Any] = {}
    for p in op.get("parameters", []):
        if p["in"] == "path":
            value = draw(st.one_of(st.just("p"), TEXT))
            value = value.replace("/", "%2F") if p["name"] != "key" else value
            path = re.sub(r"\{" + p["name"] + r"(:path)?\}", lambda _, v=value: v, path)
        elif p["in"] == "query" and draw(st.booleans()):
            params[p["name"]] = draw(SCALAR)
    body: Any = None
    if "requestBody" in op:
        body = draw(st.one_of(
            st.fixed_dictionaries({"keys": st.lists(TEXT, max_size=5)}),
            st.dictionaries(TEXT, SCALAR, max_size=3), st.lists(SCALAR, max_size=3), SCALAR))
    raw = draw(st.binary(max_size=64)) if method == "PUT" else None
    key = draw(st.one_of(st.sampled_from(keys), st.none(), TEXT))
    return {"method": method, "path": path, "params": params, "json": body, "raw": raw,
            "key": key}


def test_no_input_makes_the_server_fail(
        api: tuple[TestClient, list[str], dict[str, Any]]) -> None:
    http, keys, schema = api
    assert len(operations(schema)) >= 12

    # deterministic in the default suite; CIUIC_FUZZ_EXAMPLES=N runs N fresh random examples
    long_run = os.environ.get("CIUIC_FUZZ_EXAMPLES")

    @settings(max_examples=int(long_run or 400), derandomize=not long_run, deadline=None,
              database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(requests(schema, keys))
    def one(req: dict[str, Any]) -> None:
        headers = {}
        if req["key"] is not None:
            try:
                f"Bearer {req['key']}".encode("latin-1")
            except UnicodeEncodeError:
                return  # not a valid HTTP header value: no client can send it
            headers["Authorization"] = f"Bearer {req['key']}"
        kwargs: dict[str, Any] = {"headers": headers, "params": {
            k: ("" if v is None else str(v)) for k, v in req["params"].items()}}
        if req["raw"] is not None:
            kwargs["content"] = req["raw"]
        elif req["json"] is not None:
            kwargs["json"] = req["json"]
        try:
            r = http.request(req["method"], req["path"], **kwargs)
        except Exception as e:  # the client refused to build the request: not the server
            if "Invalid" in type(e).__name__ or isinstance(e, (ValueError, UnicodeError)):
                return
            raise
        assert r.status_code < 500, (req, r.status_code, r.text[:300])
        if r.status_code >= 400 and req["method"] != "HEAD":
            err = r.json()["error"]
            assert err["code"] and err["message"], r.text

    one()


def test_the_fuzz_reaches_authorized_handlers(
        api: tuple[TestClient, list[str], dict[str, Any]], tmp_path: Path) -> None:
    """A fuzz that only ever met 401s would prove nothing: well-formed requests with a valid key
    get through to the handlers."""
    http, keys, _ = api
    h = {"Authorization": f"Bearer {keys[1]}"}
    chunk = "chunks/ab/" + "ab" * 32
    assert http.put(f"/v1/projects/p/objects/{chunk}", headers=h, content=b"x").status_code \
        == 200
    assert chunk in http.get("/v1/projects/p/objects?prefix=chunks/", headers=h).json()["keys"]
