"""The server's security review (issue 43, items 5, 6 and 8) replayed as an attacker would, over
real HTTP against a real `ciuic serve`: a writer of one job deleting another job's chunks and
bodies, a forged lease, a large body sent without a key, one key flooding the server with
diffs, metrics without a key; and reading the audit log (issue 42), on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from ciuic import SnapshotManager, knobs
from ciuic.catalog import Catalog
from ciuic.catalog.keys import audit, audit_log, create_key
from ciuic.catalog.models import AuditEvent
from ciuic.chain.repo import Repository
from ciuic.server import create_app
from tests.serverutil import cli, new_key, serve, serving


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, int]]:
    store = tmp_path_factory.mktemp("security") / "store"
    new_key(store, "bootstrap", "reader")  # the store exists before the server opens it
    with serving(store, store.parent / "server.log") as (url, process):
        yield url, store, process.pid


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def key_id(key: str) -> str:
    return key.split("_")[1]


def project_dir(store: Path, project: str) -> Path:
    return store / "objects" / "projects" / project


def files(root: Path, under: str) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in (root / under).rglob("*")
                  if p.is_file() and not p.name.startswith("."))


def events(store: Path, project: str, **filters: Any) -> list[dict[str, Any]]:
    with Repository.open(store) as repo:
        return audit_log(repo.catalog, project, 1000, **filters)


def test_a_writer_cannot_delete_another_jobs_chunks_or_bodies(
        server: tuple[str, Path, int]) -> None:
    """#43.5: any writer deleted another job's chunks and bodies (a chunk swapped by DELETE
    then PUT made `verify --deep` call it truncated; a body delete pruned another job's
    snapshot), unaudited. Now 403, nothing deleted, and the attempt is in the audit log."""
    url, store, _ = server
    alice, mallory = new_key(store, "vision", "writer"), new_key(store, "vision", "writer")
    admin = new_key(store, "vision", "admin")
    with knobs.override(pack_bytes=0), SnapshotManager(  # chunk objects (a pack: the same rule)
            "vision", job="alice-job", api_key=alice, endpoint=url,
                         handle_signals=False) as m:
        sid = m.save(1, {"w": torch.randn(5000), "b": torch.randn(300)}).id
    root = project_dir(store, "vision")
    chunks, bodies = files(root, "chunks"), files(root, "jobs/vision/alice-job/bodies")
    assert chunks and len(bodies) == 1
    before = {k: (root / k).read_bytes() for k in [*chunks, *bodies]}
    for key in [*chunks, *bodies]:
        r = httpx.delete(f"{url}/v1/projects/vision/objects/{key}", headers=bearer(mallory))
        assert r.status_code == 403, (key, r.status_code, r.text)
        assert r.json()["error"]["code"] == "forbidden"
    # the swap: a PUT over an existing chunk keeps the first copy
    assert httpx.put(f"{url}/v1/projects/vision/objects/{chunks[0]}", content=b"evil",
                     headers=bearer(mallory)).status_code == 200
    assert {k: (root / k).read_bytes() for k in before} == before  # nothing deleted or changed
    deep = httpx.post(f"{url}/v1/projects/vision/snapshots/{sid}/verify?deep=true",
                      headers=bearer(mallory), timeout=60).json()
    assert deep["ok"] and deep["problems"] == [], deep
    snap = httpx.get(f"{url}/v1/projects/vision/snapshots/{sid}", headers=bearer(mallory))
    assert snap.json()["status"] == "committed"
    refused = events(store, "vision", action="object.delete.refused")
    assert sorted(e["target"] for e in refused) == sorted([*chunks, *bodies])
    assert {e["actor"] for e in refused} == {f"key:{key_id(mallory)}"}
    # an admin prunes it (the body goes, audited); chunks still go only by the server's gc
    r = httpx.delete(f"{url}/v1/projects/vision/objects/{bodies[0]}", headers=bearer(admin))
    assert r.status_code == 200 and not (root / bodies[0]).exists()
    assert httpx.delete(f"{url}/v1/projects/vision/objects/{chunks[0]}",
                        headers=bearer(admin)).status_code == 403
    pruned = events(store, "vision", action="snapshot.prune")
    assert [(e["actor"], e["target"]) for e in pruned] == [(f"key:{key_id(admin)}", bodies[0])]
    # the admin reads all of it with `ciuic audit`, through the server
    at = f"{url}/v1/projects/vision"
    run = cli(at, "audit", "--action", "object.delete.refused", CIUIC_API_KEY=mallory)
    assert run.returncode != 0 and "needs the admin role" in run.stderr, run.stderr
    run = cli(at, "audit", "--action", "object.delete.refused", CIUIC_API_KEY=admin)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count(key_id(mallory)) == len(refused), run.stdout


def test_retention_over_a_server_prunes_as_the_lease_holder_and_gc_runs_on_the_server(
        server: tuple[str, Path, int]) -> None:
    """What a running job may still do: its retention deletes its own pruned bodies (its key
    holds the job's lease) and asks the server's gc to free their chunks."""
    url, store, _ = server
    key = new_key(store, "kept", "writer")
    with knobs.override(pack_bytes=0), SnapshotManager(  # chunk objects, counted
            "kept", job="j", api_key=key, endpoint=url, keep_last=1,
                         handle_signals=False) as m:
        for step in range(3):  # a new tensor each time: new chunks
            last = m.save(step, {"w": torch.randn(5000)}).id
    root = project_dir(store, "kept")
    assert len(files(root, "jobs/kept/j/bodies")) == 1
    chunks = files(root, "chunks")
    with Repository.open(store) as repo:
        assert repo.catalog.get(last).status == "committed"
    actions = [e["action"] for e in events(store, "kept")]
    assert actions.count("snapshot.prune") == 2 and "gc" in actions and "lease.take" in actions
    checked = httpx.post(f"{url}/v1/projects/kept/snapshots/{last}/verify?deep=true",
                         headers=bearer(key), timeout=60).json()
    # only the last snapshot's chunks are left: the server's gc deleted the others
    assert checked["ok"] and checked["chunks_checked"] == len(chunks), (checked, chunks)
    gcs = [e["target"] for e in events(store, "kept", action="gc")]
    assert len(gcs) == 2 and all(t.endswith("chunks, 0 bodies deleted") for t in gcs), gcs
    # `ciuic gc` through the server runs the server's gc: nothing left to delete
    run = cli(f"{url}/v1/projects/kept", "gc", CIUIC_API_KEY=key)
    assert run.returncode == 0 and "deleted 0 chunks" in run.stdout, run.stdout + run.stderr
    assert files(root, "chunks") == chunks


def test_a_forged_lease_is_refused_and_the_job_keeps_committing(
        server: tuple[str, Path, int]) -> None:
    """#43.5: a writer's plain `PUT .../leases/999999999999.json` fenced alice's job out for
    good. A lease is now created once, only as the job's next token, and never deleted."""
    url, store, _ = server
    alice, mallory = new_key(store, "leases", "writer"), new_key(store, "leases", "writer")
    base = f"{url}/v1/projects/leases/objects/jobs/leases/alice-job/leases"
    holder = json.dumps({"host": "evil", "pid": 1, "run": "x", "time": time.time()})
    with SnapshotManager("leases", job="alice-job", api_key=alice, endpoint=url,
                         handle_signals=False) as m:
        m.save(1, {"w": torch.randn(100)})
        forged = httpx.put(f"{base}/999999999999.json?create=true", content=holder,
                           headers=bearer(mallory))
        assert forged.status_code == 403, forged.text
        assert "next lease is jobs/leases/alice-job/leases/000000000002.json" in \
            forged.json()["error"]["message"]
        assert httpx.put(f"{base}/000000000002.json", content=holder,
                         headers=bearer(mallory)).status_code == 403  # a plain PUT
        assert httpx.put(f"{base}/000000000001.json?create=true", content=holder,
                         headers=bearer(mallory)).status_code == 409  # taken
        assert httpx.delete(f"{base}/000000000001.json",
                            headers=bearer(mallory)).status_code == 403
        assert httpx.put(f"{url}/v1/projects/leases/objects/locks/gc.json", content=holder,
                         headers=bearer(mallory)).status_code == 403  # would stall saves
        assert httpx.put(f"{url}/v1/projects/leases/objects/jobs/leases/x/anything.json",
                         content=b"{}", headers=bearer(mallory)).status_code == 400
        assert m.save(2, {"w": torch.randn(100)}).step == 2  # alice still commits
    root = project_dir(store, "leases")
    assert files(root, "jobs/leases/alice-job/leases") == [
        "jobs/leases/alice-job/leases/000000000001.json"]
    lease = json.loads((root / "jobs/leases/alice-job/leases/000000000001.json").read_bytes())
    assert lease["key"] == key_id(alice)  # the server noted whose key holds the job


def _vm(pid: int) -> dict[str, int]:
    """The process's memory figures, in KiB (``/proc/PID/status``)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in lines)
            if k in ("VmRSS", "VmHWM")}


def _post_head(url: str, path: str, length: int, key: str | None) -> tuple[socket.socket,
                                                                           bytes]:
    """Send a POST's headers (declaring ``length`` bytes of JSON) and nothing of its body;
    return the socket and the answer's status line and headers."""
    where = urlparse(url)
    s = socket.create_connection((where.hostname, where.port), timeout=20)
    head = (f"POST {path} HTTP/1.1\r\nHost: {where.netloc}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {length}\r\n"
            + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n")
    s.sendall(head.encode())
    answer = b""
    while b"\r\n\r\n" not in answer:  # before the fix: no answer until the body came (timeout)
        part = s.recv(65536)
        if not part:
            break
        answer += part
    return s, answer


def test_a_large_body_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """#43.6: FastAPI parsed a JSON body before the key was checked: a 200 MiB POST with no key
    took the server from 338 to 905 MiB before its 401. The key is checked first now, and a
    body over the cap is refused from its Content-Length."""
    store = tmp_path / "store"
    writer = new_key(store, "vision", "writer")
    size = 50 * 1024 * 1024
    body = b'{"keys": ["' + b"a" * (size - 14) + b'"]}'
    assert len(body) == size
    with serving(store, tmp_path / "server.log") as (url, process):  # a fresh one: its peak is now
        _flood_and_measure(url, process.pid, body, writer)


def _flood_and_measure(url: str, pid: int, body: bytes, writer: str) -> None:
    size = len(body)
    before = _vm(pid)
    s, answer = _post_head(url, "/v1/projects/vision/objects/missing", size, None)
    assert answer.startswith(b"HTTP/1.1 401"), answer
    try:  # the whole body, as an attacker sends it: the server does not read it
        for i in range(0, size, 1 << 20):
            s.sendall(body[i:i + (1 << 20)])
    except OSError:
        pass  # the server closed the connection after its answer
    s.close()
    after = _vm(pid)
    grown = after["VmHWM"] - before["VmHWM"]
    assert grown < 16 * 1024, (before, after)  # KiB; reading the body would be 100+ MiB
    s, answer = _post_head(url, "/v1/projects/vision/objects/missing", 17 * 1024 * 1024,
                           writer)  # over the 16 MiB cap of a JSON request: refused at once
    s.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_body_over_the_cap_without_a_length_is_refused(tmp_path: Path) -> None:
    store = tmp_path / "store"
    with Repository.open(store) as repo:
        key = create_key(repo.catalog, "p", "writer")[0]
    with TestClient(create_app(str(store), json_max_bytes=1000)) as http:
        url = "/v1/projects/p/objects/missing"
        h = {**bearer(key), "Content-Type": "application/json"}
        small = json.dumps({"keys": ["chunks/aa/" + "aa" * 32]}).encode()
        assert http.post(url, content=small, headers=h).json() == {
            "missing": ["chunks/aa/" + "aa" * 32]}
        big = json.dumps({"keys": ["chunks/aa/" + "aa" * 32] * 20}).encode()
        r = http.post(url, content=iter([big[:500], big[500:]]), headers=h)  # chunked
        assert r.status_code == 413 and "limited to 1000 bytes" in r.json()["error"]["message"]
        assert http.post(url, content=big, headers=h).status_code == 413


def test_one_key_flooding_diffs_gets_429_while_another_key_is_served(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """#43.8: diffs and tensor statistics waited on a global lock holding server threads: 45
    queued diffs from one reader took another project's `whoami` from 0.03 to 4.4 s. One read
    per key at a time now; the rest are refused at once (429), as deep checks are."""
    store = tmp_path / "store"
    writer, flood = new_key(store, "p", "writer"), new_key(store, "p", "reader")
    other = new_key(store, "q", "reader")
    monkeypatch.setenv("CIUIC_FAILPOINTS", "server.inspect=sleep:5")  # the server's: a long read
    with serve(store, tmp_path / "server.log") as url:
        with SnapshotManager("p", api_key=writer, endpoint=url, handle_signals=False) as m:
            a = m.save(1, {"w": torch.randn(1000)}).id
            b = m.save(2, {"w": torch.randn(1000)}).id
        barrier = threading.Barrier(8)
        answers: list[httpx.Response] = []

        def diff() -> None:
            barrier.wait()
            answers.append(httpx.get(f"{url}/v1/projects/p/diff", params={"a": a, "b": b},
                                     headers=bearer(flood), timeout=60))

        threads = [threading.Thread(target=diff) for _ in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(answers) < 7 and time.monotonic() < deadline:
            time.sleep(0.05)  # the refusals come back at once; one diff is still reading
        who = httpx.get(f"{url}/v1/whoami", headers=bearer(other), timeout=30)
        for t in threads:
            t.join()
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 429} and codes.count(200) >= 1 and codes.count(429) >= 6, codes
    busy = next(r for r in answers if r.status_code == 429).json()["error"]
    assert busy["code"] == "busy" and "one at a time per key" in busy["message"]
    assert who.status_code == 200 and who.json()["project"] == "q"


def test_metrics_need_a_key_and_show_only_its_project(server: tuple[str, Path, int]) -> None:
    """#43.8: /metrics needed no key and listed every project's name."""
    url, store, _ = server
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_key"
    writer = new_key(store, "metered", "writer")
    with SnapshotManager("metered", api_key=writer, endpoint=url, handle_signals=False) as m:
        m.save(1, {"w": torch.randn(10)})
    mine = httpx.get(f"{url}/metrics", headers=bearer(writer)).text
    assert 'ciuic_snapshots_total{project="metered"} 1.0' in mine
    assert 'project="' not in mine.replace('project="metered"', "")  # no other project's name
    other = httpx.get(f"{url}/metrics", headers=bearer(new_key(store, "elsewhere", "reader")))
    assert other.status_code == 200 and "metered" not in other.text
    assert "ciuic_requests_total" in other.text


@pytest.fixture(params=["sqlite", "postgresql"])
def catalog_url(request: pytest.FixtureRequest) -> str | None:
    return None if request.param == "sqlite" else str(request.getfixturevalue("pg_url"))


def test_an_admin_reads_the_audit_log_by_project_key_action_and_time(
        tmp_path: Path, catalog_url: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """#42.10: the audit log could be read only with sqlite3. An admin reads its project's,
    filtered and paged, through the API and `ciuic audit`; on SQLite and PostgreSQL."""
    store = tmp_path / "store"
    if catalog_url:
        monkeypatch.setenv("CIUIC_CATALOG", catalog_url)
    with Repository.open(store, catalog_url) as repo:
        keys = {role: create_key(repo.catalog, "p", role)[0]
                for role in ("reader", "writer", "admin")}
        foreign = create_key(repo.catalog, "q", "admin")[0]
        catalog: Catalog = repo.catalog
        with catalog.session() as s:  # two old events, at known times
            s.add(AuditEvent(at="2026-01-01T10:00:00.000000Z", actor="key:old", project="p",
                             action="snapshot.read", target="old-1", remote=""))
            s.add(AuditEvent(at="2026-01-02T10:00:00.000000Z", actor="key:old", project="p",
                             action="snapshot.read", target="old-2", remote=""))
        audit(catalog, "key:x", "q", "snapshot.save", "q's secret job")
    with TestClient(create_app(str(store), catalog_url)) as http:
        h = bearer(keys["writer"])
        manifest = "jobs/p/default/manifests/" + "ab" * 32 + ".json"
        assert http.put(f"/v1/projects/p/objects/{manifest}?create=true", headers=h,
                        content=b"{}").status_code == 201
        assert http.get(f"/v1/projects/p/objects/{manifest}",
                        headers=bearer(keys["reader"])).status_code == 200
        route = "/v1/projects/p/audit"
        assert http.get(route).status_code == 401
        assert http.get(route, headers=bearer(keys["writer"])).status_code == 403
        assert http.get(route, headers=bearer(foreign)).status_code == 403
        every = http.get(route, headers=bearer(keys["admin"])).json()
        assert every["next"] is None
        got = every["events"]
        assert [e["action"] for e in got] == ["snapshot.read", "snapshot.save"] + [
            "snapshot.read"] * 2 + ["apikey.create"] * 3  # in the order they were written
        assert all(e["project"] == "p" for e in got)  # never q's
        assert [e["id"] for e in got] == sorted((e["id"] for e in got), reverse=True)

        def ask(**params: Any) -> dict[str, Any]:
            r = http.get(route, params=params, headers=bearer(keys["admin"]))
            assert r.status_code == 200, r.text
            return dict(r.json())

        saves = ask(action="snapshot.save")["events"]
        assert [(e["actor"], e["target"]) for e in saves] == [
            (f"key:{key_id(keys['writer'])}", f"default {'ab' * 32}")]
        assert [e["action"] for e in ask(key=key_id(keys["reader"]))["events"]] == [
            "snapshot.read"]
        old = ask(since="2026-01-01", until="2026-01-02T10:00:00Z")["events"]
        assert [e["target"] for e in old] == ["old-1"]
        assert [e["target"] for e in ask(until="2026-01-03")["events"]] == ["old-2", "old-1"]
        pages, before = [], None
        while True:
            page = ask(limit=3, **({"before": before} if before else {}))
            pages += page["events"]
            before = page["next"]
            if before is None:
                break
        assert pages == got
        bad = http.get(route, params={"since": "yesterday"}, headers=bearer(keys["admin"]))
        assert bad.status_code == 400 and "not a time" in bad.json()["error"]["message"]
    run = cli(store, "audit", "--project", "p", "--action", "snapshot.save")
    assert run.returncode == 0, run.stderr
    assert key_id(keys["writer"]) in run.stdout and "snapshot.save" in run.stdout
    assert "q's secret" not in run.stdout
    run = cli(store, "audit", "--limit", "3")
    assert run.returncode == 0 and "older events: add --before" in run.stderr
    assert "q's secret" in run.stdout  # on the server's machine: every project


def test_the_layout_names_the_kind_of_every_key_ciuic_writes() -> None:
    """What the server's policy sorts keys by (``layout.kind_of``): every key ciuic writes has a
    kind; a near miss has none (the server refuses it)."""
    from ciuic.format import layout

    d = "ab" * 32
    assert [layout.kind_of(key) for key in (
        layout.chunk_key(d), layout.pack_key(d), layout.manifest_key("p", "j", d),
        layout.body_key("p", "j", d), layout.lease_key("p", "j", 7),
        layout.lease_key("p", "j", 10**12), layout.inflight_key("x.json"),
        layout.probe_key("r"), layout.PASSPHRASE_SALT, layout.GC_LOCK, layout.GC_EPOCH)] == [
        "chunk", "pack", "manifest", "body", "lease", "lease", "inflight", "probe", "salt",
        "gc", "gc"]
    for near_miss in (f"chunks/cd/{d}", "chunks/ab/x", f"packs/cd/{d}", "packs/ab/x",
                      f"packs/{d}", f"jobs/p/j/manifests/{d}",
                      "jobs/p/j/leases/7.json", "jobs/p/j/leases/0000000000007.json",
                      "jobs/p/j/commit", "locks/other.json", "keys/other", "probes/a/b.json"):
        assert layout.kind_of(near_miss) is None, near_miss
    assert layout.newest_lease(["jobs/p/j/leases/999999999999.json",
                                "jobs/p/j/leases/1000000000000.json"]) \
        == "jobs/p/j/leases/1000000000000.json"
