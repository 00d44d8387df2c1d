"""The server (`ciuic serve`), its keys and roles, the seed-2 client, and SnapshotManager over
HTTP. End-to-end tests run a real `ciuic serve` process (uvicorn) on a free loopback port; the
role matrix and input validation use FastAPI's in-process client on the same app factory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from torch import nn

from ciuic import SnapshotManager, knobs
from ciuic.catalog import Catalog
from ciuic.catalog.keys import audit_log, create_key, revoke_key
from ciuic.chain.repo import Repository
from ciuic.format.records import RUN_FIELDS
from ciuic.server import create_app
from ciuic.threads import Pools
from tests.s3server import free_port
from tests.serverutil import cli, new_key, serve


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    store = tmp_path_factory.mktemp("server") / "store"
    new_key(store, "bootstrap", "reader")  # creates the store before the server opens it
    with serve(store, store.parent / "server.log") as url:
        yield url, store


def test_apikey_cli_shows_the_key_once_and_stores_only_its_hash(tmp_path: Path) -> None:
    store = tmp_path / "store"
    key = new_key(store, "vision", "writer")
    listed = cli(store, "apikey", "list")
    assert listed.returncode == 0 and key.split("_")[1] in listed.stdout
    assert key not in listed.stdout and key.split("_", 2)[2] not in listed.stdout
    assert key.split("_", 2)[2].encode() not in (store / "catalog.db").read_bytes()
    # a key makes its project, not a job: `ciuic ls` listed an empty "vision/default"
    assert "vision/default" not in cli(store, "ls").stdout
    with Repository.open(store) as repo:
        assert repo.catalog.jobs() == []
    revoked = cli(store, "apikey", "revoke", key.split("_")[1])
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    bad = cli(store, "apikey", "create", "--project", "vision", "--role", "owner")
    assert bad.returncode != 0 and "role must be one of reader, writer, admin" in bad.stderr
    repo = Repository.open(store)
    actions = [e["action"] for e in audit_log(repo.catalog, "vision")]
    repo.close()
    assert actions == ["apikey.revoke", "apikey.create"]


# not tests/models.py's: a ReLU between the layers (the tests name model[2])
def mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def test_the_seed_2_client_code_runs_as_written(server: tuple[str, Path]) -> None:
    url, store = server
    key = new_key(store, "deepseek", "writer")
    from ciuic_client import CiuicClient

    client = CiuicClient(api_key=key, endpoint=url)
    assert client.project == "deepseek" and client.job == "default"
    model, optimizer = mlp()
    for epoch in range(2):
        snapshot_data = {
            'model_state_dict': model.state_dict(),
            'optimizer_state_dict': optimizer.state_dict(),
            'epoch': epoch + 1,
            'loss': 0.5 / (epoch + 1),
        }
        saved = client.save_snapshot(snapshot_data)
        assert saved["step"] == epoch + 1
    latest = client.get_latest_snapshot()
    assert set(latest) == {"id", "step", "created", "data"} and latest["step"] == 2
    data = latest["data"]
    fresh, fresh_opt = mlp()
    fresh.load_state_dict(data["model_state_dict"])
    fresh_opt.load_state_dict(data["optimizer_state_dict"])
    assert data["epoch"] == 2 and data["loss"] == 0.25
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    # the second snapshot sent only what changed: nothing (same tensors)
    listed = client.list_snapshots()
    assert [s["step"] for s in listed] == [2, 1]
    client.close()
    with TestClient(create_app(str(store))) as http:
        body = http.get("/v1/projects/deepseek/jobs/default/snapshots",
                        headers={"Authorization": f"Bearer {key}"}).json()
    assert body["total"] == 2
    first, second = body["snapshots"][1], body["snapshots"][0]
    assert first["new_bytes"] > 0 and second["new_bytes"] == 0


def test_snapshot_manager_over_http_restores_and_keeps_encryption_on_the_client(
        server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    url, store = server
    key = new_key(store, "llm", "writer")
    from ciuic.format.crypto import generate_key_text

    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", generate_key_text())
    model, opt = mlp()
    with SnapshotManager("llm", api_key=key, endpoint=url, encryption=True,
                         handle_signals=False) as m:
        m.save(7, model, opt, epoch=3)
        with torch.no_grad():  # 1 of 4 tensors changes: only its chunks go up again
            model[0].bias.add_(1.0)
        second = m.save(8, model, opt)
        assert 0 < second.new_bytes < second.total_bytes // 2
    fresh, fresh_opt = mlp()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    monkeypatch.setenv("CIUIC_ENDPOINT", url)
    monkeypatch.setenv("CIUIC_API_KEY", key)
    with SnapshotManager("llm", encryption=True, handle_signals=False) as m:
        assert m.restore(fresh, fresh_opt) == 8
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    # the server's storage holds ciphertext only: no tensor bytes, no state names
    raw = model[2].weight.detach().numpy().tobytes()[:64]
    for path in (store / "objects" / "projects" / "llm").rglob("*"):
        if path.is_file():
            blob = path.read_bytes()
            assert raw not in blob and b"exp_avg" not in blob and b"epoch" not in blob, path


# -- roles, projects and validation (in-process) --------------------------------------------

def chunk(c: str) -> str:
    """A well-formed chunk key (the server takes only the layout's keys)."""
    return f"chunks/{c}/{c * 32}"


ROUTES: list[tuple[str, str, str]] = [  # method, path (project p), the least role it needs
    ("GET", "/v1/projects/p/jobs", "reader"),
    ("GET", "/v1/projects/p/jobs/default/snapshots", "reader"),
    ("GET", "/v1/projects/p/jobs/default/snapshots/latest", "reader"),
    ("GET", "/v1/projects/p/snapshots/{sid}", "reader"),
    ("GET", "/v1/projects/p/objects?prefix=jobs/", "reader"),
    ("GET", "/v1/projects/p/objects/jobs/p/default/manifests/{sid}.json", "reader"),
    ("HEAD", "/v1/projects/p/objects/jobs/p/default/manifests/{sid}.json", "reader"),
    ("POST", "/v1/projects/p/objects/missing", "writer"),
    ("PUT", f"/v1/projects/p/objects/{chunk('aa')}", "writer"),
    ("PUT", "/v1/projects/p/objects/inflight/test-object", "writer"),
    ("DELETE", "/v1/projects/p/objects/inflight/test-object", "writer"),
    ("POST", "/v1/projects/p/gc?dry_run=true", "writer"),
    ("GET", "/v1/projects/p/audit", "admin"),
    ("DELETE", "/v1/projects/p/snapshots/{sid}", "admin"),
]


@pytest.fixture()
def app_with_keys(tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str], str]]:
    store = tmp_path / "store"
    repo = Repository.open(store)
    keys = {role: create_key(repo.catalog, "p", role)[0] for role in ("reader", "writer",
                                                                         "admin")}
    keys["foreign"] = create_key(repo.catalog, "q", "admin")[0]
    revoked, info = create_key(repo.catalog, "p", "admin")
    revoke_key(repo.catalog, info.id)
    keys["revoked"] = revoked
    expired, info = create_key(repo.catalog, "p", "admin", expires_days=1)
    from ciuic.catalog.models import ApiKey

    with repo.catalog.session() as s:
        s.get(ApiKey, info.id).expires = "2020-01-01T00:00:00.000000Z"  # type: ignore[union-attr]
    keys["expired"] = expired
    repo.close()
    with TestClient(create_app(str(store))) as http:
        yield http, keys, str(store)


def _call(http: TestClient, method: str, path: str, key: str | None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if method == "POST":
        return http.post(path, headers=headers, json={"keys": [chunk("aa")]})
    if method == "PUT":
        return http.put(path, headers=headers, content=b"hello")
    return http.request(method, path, headers=headers)


def test_every_endpoint_times_every_role_and_a_foreign_project(
        app_with_keys: tuple[TestClient, dict[str, str], str]) -> None:
    http, keys, store = app_with_keys
    # one real snapshot in project p, saved by a writer through the API
    model, _ = mlp()
    sid = _save_through(http, keys["writer"], store, model)
    order = ["reader", "writer", "admin"]
    checked = 0
    for method, template, needs in ROUTES:
        path = template.format(sid=sid)
        for who in ("none", "garbage", "revoked", "expired"):
            key = {"none": None, "garbage": "ciuic_000000000000_nope-nope-nope-nope-nope"}.get(
                who, keys.get(who))
            r = _call(http, method, path, key)
            assert r.status_code == 401, (method, path, who, r.status_code)
            checked += 1
        r = _call(http, method, path, keys["foreign"])
        assert r.status_code == 403, (method, path, "foreign", r.status_code)
        if method != "HEAD":
            assert "belongs to project 'q'" in r.json()["error"]["message"]
        for role in order:
            r = _call(http, method, path, keys[role])
            if order.index(role) < order.index(needs):
                assert r.status_code == 403, (method, path, role, r.status_code)
            else:
                assert r.status_code in (200, 201, 404), (method, path, role, r.status_code,
                                                          r.text)
            checked += 1
    assert checked == len(ROUTES) * 7


def _in_process_store(http: TestClient, key: str) -> Any:
    """An :class:`HttpStore` of project p whose transport is the in-process app."""
    from ciuic.store.http import HttpStore

    class Local(HttpStore):  # the same client, its transport the in-process app
        def __init__(self) -> None:
            self.endpoint, self.project = "http://testserver", "p"
            self.url = "http://testserver/v1/projects/p"
            import httpx

            self._httpx = httpx
            self._client = http  # type: ignore[assignment]
            self._pools = Pools(2, "test-http")

        def _call(self, method: str, path: str, **kw: Any) -> Any:
            kw.setdefault("headers", {})["Authorization"] = f"Bearer {key}"
            return super()._call(method, "/v1/projects/p" + path, **kw)

        def close(self) -> None:  # the test owns the client
            self._pools.shutdown()

    return Local()


def _save_through(http: TestClient, key: str, store: str, model: nn.Module) -> str:
    """Save one snapshot of ``model`` into project p through the in-process app."""
    with SnapshotManager("p", store=_in_process_store(http, key), handle_signals=False) as m:
        return m.save(1, model).id


def test_an_object_is_read_by_byte_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    """``Range: bytes=`` answers 206 with those bytes (``Content-Range``), 416 with the size
    past the end, the whole object for a range it does not serve; a range over the server's
    per-answer limit comes in several answers, which the HTTP store asks for in turn."""
    from ciuic.server import app as server_app

    store = tmp_path / "store"
    key = new_key(store, "p", "writer")
    data = os.urandom(5000)
    auth = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(str(store), layout_keys_only=False)) as http:
        url = "/v1/projects/p/objects/conformance/range"
        assert http.put(url, content=data, headers=auth).status_code in (200, 201)
        r = http.get(url, headers={**auth, "Range": "bytes=100-199"})
        assert r.status_code == 206 and r.content == data[100:200]
        assert r.headers["content-range"] == "bytes 100-199/5000"
        r = http.get(url, headers={**auth, "Range": "bytes=4990-"})
        assert r.status_code == 206 and r.content == data[4990:]
        r = http.get(url, headers={**auth, "Range": "bytes=5000-5100"})
        assert r.status_code == 416 and r.headers["content-range"] == "bytes */5000"
        assert r.json()["error"]["code"] == "range_past_end"
        for ignored in ("bytes=-100", "bytes=9-3", "bytes=0-1,5-6", "items=0-4"):
            r = http.get(url, headers={**auth, "Range": ignored})
            assert r.status_code == 200 and r.content == data, ignored
        monkeypatch.setattr(server_app, "RANGE_MAX_BYTES", 1000)
        r = http.get(url, headers={**auth, "Range": "bytes=0-4999"})
        assert r.status_code == 206 and r.headers["content-range"] == "bytes 0-999/5000"
        client = _in_process_store(http, key)
        try:
            a, b = bytearray(1500), bytearray(2400)
            assert client.get_into("conformance/range", [memoryview(a), memoryview(b)],
                                   600) == 5000
            assert bytes(a + b) == data[600:4500]
        finally:
            client.close()


def test_a_batch_of_small_objects_goes_to_the_server_in_parallel(
        server: tuple[str, Path]) -> None:
    """A batch of a model's small chunks is sent in parallel requests, not one round trip
    after another: each PUT here waits at a barrier for a second one to be in flight (one at a
    time, the barrier would break and the batch fail)."""
    from ciuic.store.http import HttpStore

    url, store = server
    s = HttpStore(f"{url}/v1/projects/batches", api_key=new_key(store, "batches", "writer"))
    barrier = threading.Barrier(2, timeout=20)
    met: list[str] = []

    def in_pairs(request: Any) -> None:
        if request.method == "PUT":
            barrier.wait()
            met.append(request.url.path)

    s._client.event_hooks = {"request": [in_pairs], "response": []}
    keys = [chunk(c) for c in ("a0", "a1", "a2", "a3")]
    s.put_many([(k, k.encode() * 100) for k in keys], durable=False)
    assert sorted(met) == sorted(f"/v1/projects/batches/objects/{k}" for k in keys)
    s._client.event_hooks = {"request": [], "response": []}
    assert [s.get(k) for k in keys] == [k.encode() * 100 for k in keys]
    s.close()


def test_names_keys_and_sizes_are_checked_with_clear_json_errors(
        app_with_keys: tuple[TestClient, dict[str, str], str]) -> None:
    http, keys, _ = app_with_keys
    h = {"Authorization": f"Bearer {keys['admin']}"}
    for path in ("/v1/projects/p/objects/..%2F..%2Fetc%2Fpasswd",
                 "/v1/projects/p/objects/chunks/../../x",
                 "/v1/projects/p/objects/jobs/q/default/manifests/x.json",
                 "/v1/projects/p/objects/a//b"):
        r = http.put(path, headers=h, content=b"x")
        assert r.status_code in (400, 404), (path, r.status_code)
        if r.status_code == 400:
            assert r.json()["error"]["code"] in ("invalid_name", "invalid_request"), r.text
    r = http.get("/v1/projects/bad name!/jobs", headers=h)
    assert r.status_code in (400, 403, 404)
    r = http.get("/v1/projects/p/jobs/default/snapshots?limit=0", headers=h)
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]
    r = http.get("/v1/projects/p/snapshots/not-hex", headers=h)
    assert r.status_code == 400
    r = http.delete("/v1/projects/p/objects/jobs/p/default/manifests/" + "0" * 64 + ".json",
                    headers=h)
    assert r.status_code == 403 and "kept forever" in r.json()["error"]["message"]


def test_uploads_over_the_limit_are_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    repo = Repository.open(store)
    key = create_key(repo.catalog, "p", "writer")[0]
    repo.close()
    with TestClient(create_app(str(store), max_object_bytes=1000)) as http:
        h = {"Authorization": f"Bearer {key}"}
        assert http.put(f"/v1/projects/p/objects/{chunk('aa')}", headers=h,
                        content=b"x" * 1000).status_code == 200
        r = http.put(f"/v1/projects/p/objects/{chunk('bb')}", headers=h, content=b"x" * 1001)
        assert r.status_code == 413 and "limited to 1000 bytes" in r.json()["error"]["message"]
        assert http.head(f"/v1/projects/p/objects/{chunk('bb')}", headers=h).status_code == 404


def test_the_api_is_described_by_its_openapi_schema(tmp_path: Path) -> None:
    with TestClient(create_app(str(tmp_path / "store"))) as http:
        schema = http.get("/openapi.json").json()
    paths = schema["paths"]
    for p in ("/health", "/v1/whoami", "/v1/projects/{project}/jobs/{job}/snapshots",
              "/v1/projects/{project}/objects/missing", "/v1/projects/{project}/objects/{key}"):
        assert p in paths, sorted(paths)


def test_the_audit_log_records_saves_reads_and_deletes(
        app_with_keys: tuple[TestClient, dict[str, str], str]) -> None:
    http, keys, store = app_with_keys
    model, _ = mlp()
    sid = _save_through(http, keys["writer"], store, model)
    h = {"Authorization": f"Bearer {keys['reader']}"}
    assert http.get(f"/v1/projects/p/objects/jobs/p/default/manifests/{sid}.json",
                    headers=h).status_code == 200
    r = http.delete(f"/v1/projects/p/snapshots/{sid}",
                    headers={"Authorization": f"Bearer {keys['admin']}"})
    assert r.status_code == 200 and r.json()["status"] == "pruned"
    repo = Repository.open(store)
    events = audit_log(repo.catalog, "p")
    repo.close()
    actions = [e["action"] for e in events]
    for action in ("snapshot.save", "snapshot.read", "snapshot.delete", "apikey.create",
                   "apikey.revoke"):
        assert action in actions, actions
    save = next(e for e in events if e["action"] == "snapshot.save")
    writer_id = keys["writer"].split("_")[1]
    assert save["actor"] == f"key:{writer_id}" and sid in save["target"]
    assert os.path.exists(store)


def test_a_clients_run_report_reaches_the_servers_catalog_field_for_field(
        app_with_keys: tuple[TestClient, dict[str, str], str], tmp_path: Path) -> None:
    """A run as a client's catalog holds it, sent as ciuic.manager.report sends it (the run's
    fields, then its events), is the same row and the same events in the server's catalog; the
    server lists its job with the JSON fields of a job's row."""
    http, keys, store = app_with_keys
    client = Catalog(f"sqlite:///{tmp_path / 'client.db'}")
    run_id = "0123456789abcdef"
    client.start_run("p", "j", run_id)
    client.event(run_id, "p", "j", "snapshot", 5, "s" * 64)
    client.heartbeat(run_id, 7)
    client.interrupted_by(run_id, "hang: no step() for 600 s")
    client.end_run(run_id, "signal:SIGTERM", 7)
    report, last = client.run_report(run_id, 0)
    assert report is not None and len(report.events) == 4 and last > 0
    body = report.to_json()
    assert list(body) == [*RUN_FIELDS, "events"]
    assert list(body["events"][0]) == ["at", "kind", "step", "detail"]
    writer = {"Authorization": f"Bearer {keys['writer']}"}
    r = http.put(f"/v1/projects/p/jobs/j/runs/{run_id}", headers=writer, json=body)
    assert r.status_code == 200 and r.json() == {"run": run_id, "events": 4, "added": 4}
    again = http.put(f"/v1/projects/p/jobs/j/runs/{run_id}", headers=writer, json=body)
    assert again.json() == {"run": run_id, "events": 4, "added": 0}  # safe to send again
    server = Catalog(f"sqlite:///{Path(store) / 'catalog.db'}")
    try:
        [mine], [theirs] = client.runs("p", "j"), server.runs("p", "j")
        assert theirs == replace(mine, job_id=theirs.job_id)
        assert server.events("p", "j") == client.events("p", "j")
    finally:
        server.close()
        client.close()
    [row] = [j for j in http.get("/v1/projects/p/jobs", headers=writer).json()["jobs"]
             if j["job"] == "j"]
    assert row == {"project": "p", "job": "j", "snapshots": 0, "max_step": None,
                   "new_bytes": 0, "latest": None}
    assert list(row) == ["project", "job", "snapshots", "max_step", "new_bytes", "latest"]


ENDPOINT_JOB = """
import os, signal, sys
import torch
from torch import nn
from ciuic import SnapshotManager

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
url, key, steps, kill = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with SnapshotManager("runs", job="j", endpoint=url, api_key=key, save_interval=2) as m:
    last = m.restore(model, opt)
    for step in range(0 if last is None else last + 1, steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        m.step(step, model, opt)
        if step == kill:
            m.wait()
            os.kill(os.getpid(), signal.SIGKILL)
"""


def test_restarts_of_a_job_on_a_server_do_not_duplicate_its_run_history(
        server: tuple[str, Path], tmp_path: Path) -> None:
    """Three runs of a job on a server, the second SIGKILLed: each run sends the previous run's
    record again (all of its events: the killed one may not have sent its last ones), and the
    server keeps each event once, as the client's catalog has them. (It appended them again:
    each run's events twice but the last's, and `resumed by run R` twice.)"""
    url, store = server
    key = new_key(store, "runs", "writer")
    job = tmp_path / "job.py"
    job.write_text(ENDPOINT_JOB)
    for steps, kill, rc in ((4, -1, 0), (9, 6, -9), (9, -1, 0)):
        run = subprocess.run([sys.executable, str(job), url, key, str(steps), str(kill)],
                             capture_output=True, text=True, timeout=180)
        assert run.returncode == rc, run.stderr[-3000:]
    [cache] = (tmp_path / "cache" / "ciuic").glob("*.db")  # the client's catalog
    client, theirs = Catalog(f"sqlite:///{cache}"), Catalog(f"sqlite:///{store / 'catalog.db'}")
    try:
        mine = client.events("runs", "j", limit=1000)
        told = theirs.events("runs", "j", limit=1000)
        assert len({e.run for e in mine}) == 3
        assert sorted(told, key=repr) == sorted(mine, key=repr)
        with TestClient(create_app(str(store))) as http:
            body = http.get("/v1/projects/runs/jobs/j/snapshots",
                            headers={"Authorization": f"Bearer {key}"}).json()
        notes = [n for s in body["snapshots"] for n in s["notes"]]
        assert len(notes) == len(set(notes)) == 3, notes  # two resumes, one kill
    finally:
        client.close()
        theirs.close()


def test_a_shutdown_during_a_commit_finishes_the_commit(tmp_path: Path) -> None:
    """SIGTERM while a commit is being written: the server finishes it (the client gets its
    201), then exits cleanly; the object is in the store."""
    import signal
    import threading

    import httpx

    store = tmp_path / "store"
    key = new_key(store, "p", "writer")
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "ciuic", "--store", str(store), "serve",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "CIUIC_FAILPOINTS": "server.put=sleep:2"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        result: dict[str, Any] = {}
        key_path = "jobs/p/default/manifests/" + "ab" * 32 + ".json"

        def commit() -> None:
            r = httpx.put(f"{url}/v1/projects/p/objects/{key_path}?create=true",
                          content=b"{}", headers={"Authorization": f"Bearer {key}"},
                          timeout=30)
            result["status"] = r.status_code

        t = threading.Thread(target=commit)
        t.start()
        time.sleep(0.8)  # the request is inside the slowed store write
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        # uvicorn finishes the requests in flight, then re-raises the signal (exit by SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    assert result.get("status") == 201, (result, (tmp_path / "server.log").read_text()[-2000:])
    assert (store / "objects" / "projects" / "p" / key_path).exists()
    logged = (tmp_path / "server.log").read_text()
    assert "Finished server process" in logged
    import json

    lines = [json.loads(x) for x in logged.splitlines() if x.startswith('{"method"')]
    assert {"method": "PUT", "status": 201} in [{k: x[k] for k in ("method", "status")}
                                                for x in lines]  # the JSON access log


def test_metrics_and_structured_access_logs(
        app_with_keys: tuple[TestClient, dict[str, str], str],
        caplog: pytest.LogCaptureFixture) -> None:
    import json
    import logging

    http, keys, _ = app_with_keys
    h = {"Authorization": f"Bearer {keys['writer']}"}
    with caplog.at_level(logging.INFO, logger="ciuic.server.access"):
        assert http.get("/v1/whoami", headers=h).status_code == 200
        assert http.get("/v1/whoami").status_code == 401
        manifest = "jobs/p/default/manifests/" + "cd" * 32 + ".json"
        assert http.put(f"/v1/projects/p/objects/{manifest}?create=true", headers=h,
                        content=b"x" * 100).status_code == 201
    text = http.get("/metrics", headers=h).text
    assert 'ciuic_requests_total{method="GET",route="/v1/whoami",status="200"} 1.0' in text
    assert 'ciuic_requests_total{method="GET",route="/v1/whoami",status="401"} 1.0' in text
    assert 'ciuic_snapshots_total{project="p"} 1.0' in text
    assert 'ciuic_object_bytes_total{direction="in"} 100.0' in text
    assert 'ciuic_request_seconds_count{method="PUT",route="/v1/projects/{project}/objects/' \
           '{key:path}"} 1.0' in text
    lines = [json.loads(r.getMessage()) for r in caplog.records
             if r.name == "ciuic.server.access"]
    assert [(x["route"], x["status"]) for x in lines] == [
        ("/v1/whoami", 200), ("/v1/whoami", 401),
        ("/v1/projects/{project}/objects/{key:path}", 201)]
    assert lines[0]["key"] == keys["writer"].split("_")[1] and lines[1]["key"] is None


def test_the_batch_missing_call_and_the_commit_semantics(
        app_with_keys: tuple[TestClient, dict[str, str], str]) -> None:
    http, keys, _ = app_with_keys
    h = {"Authorization": f"Bearer {keys['writer']}"}
    assert http.put(f"/v1/projects/p/objects/{chunk('aa')}", headers=h,
                    content=b"1").status_code == 200
    r = http.post("/v1/projects/p/objects/missing", headers=h,
                  json={"keys": [chunk("aa"), chunk("bb"), chunk("cc")]})
    assert r.status_code == 200 and r.json() == {"missing": [chunk("bb"), chunk("cc")]}
    bad = http.post("/v1/projects/p/objects/missing", headers=h, json={"keys": ["../x"]})
    assert bad.status_code == 400
    commit = "/v1/projects/p/objects/jobs/p/default/manifests/" + "ef" * 32 + ".json"
    assert http.put(commit + "?create=true", headers=h, content=b"first").status_code == 201
    again = http.put(commit + "?create=true", headers=h, content=b"second")
    assert again.status_code == 409 and again.json()["created"] is False
    assert http.get(commit, headers=h).content == b"first"  # the first commit stands


def test_a_save_asks_the_server_once_which_chunks_it_lacks(
        app_with_keys: tuple[TestClient, dict[str, str], str]) -> None:
    from ciuic import knobs

    http, keys, store = app_with_keys
    model, _ = mlp()
    with knobs.override(chunk_bytes=4096):  # the model's weights: 20+ chunks
        _save_through(http, keys["writer"], store, model)
        with torch.no_grad():
            model[0].bias.add_(1)
        _save_through(http, keys["writer"], store, model)
    text = http.get("/metrics", headers={"Authorization": f"Bearer {keys['writer']}"}).text
    route = 'route="/v1/projects/{project}/objects/{key:path}"'
    heads = sum(int(float(n)) for n in re.findall(
        r'ciuic_requests_total\{method="HEAD",' + re.escape(route) + r',status="\d+"\} ([\d.]+)',
        text))
    assert heads <= 2  # per snapshot (the gc lock), never per chunk (20+ of them)
    assert ('ciuic_requests_total{method="POST",route="/v1/projects/{project}/objects/missing",'
            'status="200"} 2.0') in text  # one per snapshot
    puts = re.findall(r'ciuic_requests_total\{method="PUT",' + re.escape(route)
                      + r',status="(\d+)"\} (\d+)', text)
    assert puts  # chunks went up, and the second snapshot sent only what changed


def test_committed_and_content_addressed_objects_are_never_replaced(
        app_with_keys: tuple[TestClient, dict[str, str], str]) -> None:
    """Found by review: a writer could replace a committed manifest or a chunk with a plain
    PUT, breaking the chain or poisoning deduplication."""
    http, keys, _ = app_with_keys
    h = {"Authorization": f"Bearer {keys['writer']}"}
    manifest = "/v1/projects/p/objects/jobs/p/default/manifests/" + "ab" * 32 + ".json"
    assert http.put(manifest + "?create=true", headers=h, content=b"first").status_code == 201
    r = http.put(manifest, headers=h, content=b"evil")
    assert r.status_code == 403 and "never replaced" in r.json()["error"]["message"]
    chunk = "/v1/projects/p/objects/chunks/cd/" + "cd" * 32
    assert http.put(chunk, headers=h, content=b"real").status_code == 200
    assert http.put(chunk, headers=h, content=b"fake").status_code == 200
    assert http.get(manifest, headers=h).content == b"first"
    assert http.get(chunk, headers=h).content == b"real"


def test_snapshot_ids_of_other_projects_stay_invisible(
        app_with_keys: tuple[TestClient, dict[str, str], str]) -> None:
    """Found by review: an ID prefix was looked up across every project, and an ambiguous one
    listed other projects' IDs."""
    from ciuic.catalog import Catalog
    from ciuic.format.manifest import Manifest, utc_now

    http, keys, store = app_with_keys
    catalog = Catalog(f"sqlite:///{Path(store).resolve() / 'catalog.db'}")
    for i, project in enumerate(("q", "q")):
        m = Manifest(project=project, job="j", step=i, parent="", created=utc_now(),
                     body="a" * 64, body_bytes=1, total_bytes=1, new_bytes=1, tensors=1)
        catalog.add_snapshot(m, f"beef{i}" + "0" * 59)
    catalog.close()
    h = {"Authorization": f"Bearer {keys['admin']}"}
    for ref in ("beef", "beef0", "beef1" + "0" * 59):
        r = http.get(f"/v1/projects/p/snapshots/{ref}", headers=h)
        assert r.status_code == 404, r.text
        if len(ref) < 64:  # a short reference never reveals the IDs it would have matched
            assert "beef0000" not in r.text and "beef1000" not in r.text, r.text
    r = http.post("/v1/projects/p/snapshots/" + "0" * 64 + "/verify?deep=true",
                  headers={"Authorization": f"Bearer {keys['reader']}"})
    assert r.status_code == 404  # a reader may re-hash (a read), of its project's snapshots


def test_statistics_and_diff_of_nan_tensors_show_no_healthy_number(
        app_with_keys: tuple[TestClient, dict[str, str], str]) -> None:
    """Issue 30: the API gave an all-NaN tensor norm 0, and its diff max |a-b| 0 and a norm
    change of -100 %. Numbers that do not exist are null."""
    http, keys, store = app_with_keys
    torch.manual_seed(0)
    net = nn.Linear(4, 4)
    first = _save_through(http, keys["writer"], store, net)
    with torch.no_grad():
        net.weight.fill_(float("nan"))
        net.bias[0] = float("inf")
    second = _save_through(http, keys["writer"], store, net)
    h = {"Authorization": f"Bearer {keys['reader']}"}
    r = http.get(f"/v1/projects/p/snapshots/{second}/tensors", headers=h)
    assert r.status_code == 200, r.text
    stats = {t["path"]: t["stats"] for t in r.json()["tensors"]}
    assert stats["model/weight"] == {"nan": 16, "inf": 0, "min": None, "max": None,
                                     "mean": None, "norm": None}
    assert stats["model/bias"]["inf"] == 1 and stats["model/bias"]["norm"] is None
    r = http.get(f"/v1/projects/p/diff?a={first}&b={second}", headers=h)
    assert r.status_code == 200, r.text
    w = {t["path"]: t for t in r.json()["tensors"]}["model/weight"]
    assert w["changed_elements"] == 16 and w["nonfinite_b"] == 16
    assert (w["max_abs_diff"], w["norm_b"], w["rel_norm_change"]) == (None, None, None)


def test_a_reader_verifies_deeply_one_snapshot_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 30: a reader's check of a snapshot whose every chunk was corrupted said
    "verified (every chunk present)" (readers could not re-hash). Any key may now re-hash one
    snapshot's chunks; the server runs one deep check at a time and refuses a second (429);
    every answer says what it checked."""
    import httpx

    store = tmp_path / "store"
    writer, reader = new_key(store, "p", "writer"), new_key(store, "p", "reader")
    monkeypatch.setenv("CIUIC_FAILPOINTS", "server.verify.deep=sleep:4")  # the server's
    with serve(store, tmp_path / "server.log") as url:
        with knobs.override(pack_bytes=0), SnapshotManager(  # chunk objects, each damaged
                "p", api_key=writer, endpoint=url, handle_signals=False) as m:
            sid = m.save(1, {"w": torch.randn(5000), "b": torch.randn(300)}).id
        chunks = [p for p in (store / "objects" / "projects" / "p" / "chunks").rglob("*")
                  if p.is_file()]
        assert len(chunks) >= 2
        for path in chunks:  # every chunk damaged
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
        h = {"Authorization": f"Bearer {reader}"}
        check = f"{url}/v1/projects/p/snapshots/{sid}/verify"
        r = httpx.post(check, headers=h, timeout=30)
        assert r.status_code == 200, r.text
        shallow = r.json()
        assert shallow["ok"] and not shallow["deep"] and shallow["chunks_checked"] == len(chunks)
        assert "not re-read" in shallow["checked"], shallow  # it says what it did not check
        first: list[httpx.Response] = []
        running = threading.Thread(target=lambda: first.append(
            httpx.post(check + "?deep=true", headers=h, timeout=60)))
        running.start()
        time.sleep(1.5)  # the first deep check is inside the server's 4 s failpoint
        busy = httpx.post(check + "?deep=true", headers=h, timeout=30)
        running.join()
    assert busy.status_code == 429, busy.text
    assert "one deep check at a time" in busy.json()["error"]["message"]
    assert first[0].status_code == 200, first[0].text
    deep = first[0].json()
    assert deep["deep"] and not deep["ok"] and "re-hashed" in deep["checked"]
    assert len(deep["problems"]) == len(chunks), deep


def test_a_snapshot_in_a_newer_format_is_not_called_damaged(tmp_path: Path) -> None:
    """The diff endpoint (and the tensors one, where it reads chunks) called a chunk written by
    a newer ciuic (an intact object this server cannot read) "damaged" and sent the user to
    `ciuic verify`; they say to upgrade the server now."""
    import httpx

    store = tmp_path / "store"
    writer = new_key(store, "p", "writer")
    with serve(store, tmp_path / "server.log") as url:
        with knobs.override(pack_bytes=0), SnapshotManager(  # chunk objects, each rewritten
                "p", api_key=writer, endpoint=url, handle_signals=False) as m:
            first = m.save(1, {"w": torch.randn(5000)}).id
            second = m.save(2, {"w": torch.randn(5000)}).id
        for path in (store / "objects" / "projects" / "p" / "chunks").rglob("*"):
            if path.is_file():  # the frame version byte (format/chunks.py): a newer frame
                data = bytearray(path.read_bytes())
                data[4] = 2
                path.write_bytes(bytes(data))
        h = {"Authorization": f"Bearer {writer}"}
        compared = httpx.get(f"{url}/v1/projects/p/diff", params={"a": first, "b": second},
                             headers=h, timeout=30)
    assert compared.status_code == 422, compared.text
    error = compared.json()["error"]
    assert error["code"] == "newer_format" and "upgrade the server" in error["message"]
    assert "damaged" not in error["message"]
