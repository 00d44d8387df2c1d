"""JSON that an outsider can put in a store (a writer's key is enough) is a damaged object to
every reader: a manifest of ``[`` x 50 000 named by its own digest, a body of it under a valid
manifest, a lease or a gc marker of it. ``ciuic ls``, ``log`` and ``verify`` name it and exit 1
without a traceback, a restore falls back to the newest intact snapshot, and a server keeps
answering ``GET /jobs``. (Before: a ``RecursionError`` out of ``json.loads`` in every one.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest
import torch

from ciuic import SnapshotManager
from ciuic.chain import gc, lease
from ciuic.chain.repo import Repository
from ciuic.errors import CaptureError, CorruptObject, FencedOut
from ciuic.format import layout
from ciuic.format import manifest as mf
from ciuic.format.digest import digest
from ciuic.format.info import row_values
from ciuic.format.manifest import HealthVerdict, utc_now
from ciuic.store import LocalStore
from ciuic.store.http import HttpStore
from tests.serverutil import cli, new_key, serve

DEEP = b"[" * 50_000


def saved(store: Path) -> torch.nn.Linear:
    model = torch.nn.Linear(3, 2)
    with SnapshotManager("p", job="j", store=str(store), handle_signals=False) as m:
        m.save(1, model)
        with torch.no_grad():
            model.bias.add_(1.0)
        m.save(2, model)
    return model


def test_deep_json_in_a_local_store_is_named_damaged_and_a_restore_falls_back(
        tmp_path: Path) -> None:
    store = tmp_path / "s"
    model = saved(store)
    with Repository.open(store) as repo:
        latest = repo.catalog.latest("p", "j")
        assert latest is not None
        m2 = repo.read_manifest("p", "j", latest.id)
        # step 3: a valid manifest whose body is a deep nest (named by its digest), and a
        # "manifest" that is one
        m3 = dataclasses.replace(m2, step=3, parent=latest.id, body=digest(DEEP),
                                 body_bytes=len(DEEP), created=utc_now())
        repo.store.put(layout.body_key("p", "j", m3.body), DEEP)
        repo.store.put(layout.manifest_key("p", "j", m3.id), m3.encode())
        junk = layout.manifest_key("p", "j", digest(DEEP))
        repo.store.put(junk, DEEP)

    for command in (["ls"], ["log", "p/j"]):
        run = cli(store, *command)
        assert run.returncode == 1, run.stderr
        assert "Traceback" not in run.stderr
        assert f"damaged, not listed: object {junk} is damaged" in run.stderr
        assert "nested too deeply" in run.stderr
    assert "p/j" in cli(store, "ls").stdout

    checked = cli(store, "verify")
    assert checked.returncode == 1 and "Traceback" not in checked.stderr
    report = checked.stdout + checked.stderr
    assert digest(DEEP)[:12] in report and "nested too deeply" in report
    assert m3.id[:12] in report

    back = torch.nn.Linear(3, 2)
    with SnapshotManager("p", job="j", store=str(store), handle_signals=False) as m:
        assert m.restore(back) == 2
    assert torch.equal(back.bias, model.bias) and torch.equal(back.weight, model.weight)


def test_a_deep_lease_or_gc_marker_is_read_as_damaged(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    mine = lease.acquire(store, "p", "j", "run-1")
    store.put(layout.lease_key("p", "j", mine.token + 1), DEEP)
    with pytest.raises(FencedOut, match="at an unknown time"):  # a newer lease, whoever wrote it
        lease.check(store, mine)
    store.put(layout.inflight_key("deep.json"), DEEP)
    assert gc._is_live(store, layout.inflight_key("deep.json"), 60.0) is False
    store.put(layout.GC_EPOCH, DEEP)
    assert gc.read_epoch(store) == -1


def test_a_server_keeps_answering_after_a_writer_commits_a_deep_manifest(
        tmp_path: Path) -> None:
    store = tmp_path / "store"
    writer, reader = new_key(store, "p", "writer"), new_key(store, "p", "reader")
    with serve(store, tmp_path / "server.log") as url:
        with SnapshotManager("p", job="j", api_key=writer, endpoint=url,
                             handle_signals=False) as m:
            m.save(1, torch.nn.Linear(3, 2))
        objects = HttpStore(url, "p", writer)
        assert objects.create(layout.manifest_key("p", "j", digest(DEEP)), DEEP)
        objects.close()
        auth = {"Authorization": f"Bearer {reader}"}
        for _ in range(2):  # for good: the manifest stays
            jobs = httpx.get(f"{url}/v1/projects/p/jobs", headers=auth, timeout=60)
            assert jobs.status_code == 200, jobs.text
            assert [(j["job"], j["snapshots"]) for j in jobs.json()["jobs"]] == [("j", 1)]
        chain = httpx.get(f"{url}/v1/projects/p/jobs/j/snapshots", headers=auth, timeout=60)
        assert chain.status_code == 200 and len(chain.json()["snapshots"]) == 1


def test_a_value_nested_too_deeply_to_read_back_is_not_written(tmp_path: Path) -> None:
    deep: object = 1
    for _ in range(150):
        deep = [deep]
    with SnapshotManager("p", job="j", store=str(tmp_path / "s"), handle_signals=False) as m:
        m.save(1, torch.nn.Linear(3, 2))
        with pytest.raises(CaptureError, match="nests deeper than 100 levels"):
            m.save(2, torch.nn.Linear(3, 2), extra=deep)
        latest = m.latest()
        assert latest is not None and latest.step == 1


MALFORMED = [  # bodies a writer may commit under valid manifests: each a damaged snapshot
    {"extra": {"$float": None}},
    {"model": {"w": {"$tensor": {"dtype": "float32", "shape": "x", "nbytes": 8, "inline": ""}}}},
    {"model": {"w": {"$tensor": {"dtype": "float32", "shape": [2], "nbytes": 8,
                                 "shards": [1]}}}},
    {"model": {"w": {"$tensor": {"dtype": "float32", "shape": [2], "nbytes": "8",
                                 "inline": "AAAAAAAAAAA="}}}},
    {"model": {"w": {"$tensor": {"dtype": "float32", "shape": [2], "nbytes": 8,
                                 "inline": "AAAA"}}}},  # well-formed, 3 bytes where 8 are said
]


def test_a_server_names_a_snapshot_with_a_malformed_body_damaged(tmp_path: Path) -> None:
    store = tmp_path / "store"
    writer, reader = new_key(store, "p", "writer"), new_key(store, "p", "reader")
    with serve(store, tmp_path / "server.log") as url:
        with SnapshotManager("p", job="j", api_key=writer, endpoint=url,
                             handle_signals=False) as m:
            first = m.save(1, torch.nn.Linear(3, 2))
        objects = HttpStore(url, "p", writer)
        ids = []
        for step, states in enumerate(MALFORMED, start=2):
            body = mf.encode_body(states, salt="00" * 8)
            objects.put(layout.body_key("p", "j", digest(body)), body)
            made = mf.Manifest(project="p", job="j", step=step, parent=first.id,
                               created=utc_now(), body=digest(body), body_bytes=len(body),
                               total_bytes=8, new_bytes=8, tensors=1)
            assert objects.create(layout.manifest_key("p", "j", made.id), made.encode())
            ids.append(made.id)
        objects.close()
        auth = {"Authorization": f"Bearer {reader}"}
        for n, sid in enumerate(ids):
            # the last is malformed only where its bytes are read: the diff, by path, reads none
            for path in [f"snapshots/{sid}/tensors"] + [f"diff?a={first.id}&b={sid}"] * (
                    n < len(ids) - 1):
                r = httpx.get(f"{url}/v1/projects/p/{path}", headers=auth, timeout=60)
                assert r.status_code == 422, (path, r.status_code, r.text)
                assert r.json()["error"]["code"] == "damaged"


def test_a_damaged_catalog_row_is_a_damaged_object_naming_it() -> None:
    assert row_values("abc", '{"loss": 0.5}', '{"healthy": true, "reasons": []}') == (
        {"loss": 0.5}, HealthVerdict(True))
    for metrics, health in ((DEEP.decode(), None), ("[1]", None), ("{}", DEEP.decode()),
                            ("{}", '{"healthy": 1}'), ("\udcff", None)):
        with pytest.raises(CorruptObject, match="the catalog's row of snapshot abc"):
            row_values("abc", metrics, health)


def test_deeply_nested_request_bodies_are_refused_with_a_json_error(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from ciuic.catalog.keys import create_key
    from ciuic.server import create_app

    with Repository.open(tmp_path / "s") as repo:
        key = create_key(repo.catalog, "p", "writer")[0]
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    nests = [DEEP.decode(), '{"keys":' + DEEP.decode(), '{"a":' * 900 + "1" + "}" * 900]
    with TestClient(create_app(str(tmp_path / "s")), raise_server_exceptions=False) as http:
        for method, path in (("POST", "/v1/projects/p/objects/missing"),
                             ("PUT", "/v1/projects/p/jobs/j/runs/r1")):
            for body in nests:
                r = http.request(method, path, content=body, headers=headers)
                assert r.status_code == 400 and r.json()["error"]["message"], r.text

