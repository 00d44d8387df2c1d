"""The catalog on a real PostgreSQL server (started by the tests): the embedded manager, the
index's 64-bit sizes, runs and interruption detection, and the server's keys and audit log."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from torch import nn

from ciuic import SnapshotManager
from ciuic.catalog import Catalog
from ciuic.catalog.keys import audit_log, authenticate, create_key, revoke_key
from ciuic.format.manifest import Manifest, utc_now
from ciuic.server import create_app
from tests.models import linear


def test_a_job_saves_and_resumes_with_its_catalog_on_postgres(
        tmp_path: Path, pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CIUIC_CATALOG", pg_url)
    model = linear(32, 8)
    with SnapshotManager("p", store=tmp_path / "s", save_interval=2,
                         handle_signals=False) as m:
        for step in range(5):
            m.step(step, model, loss=1.0 / (step + 1))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = nn.Linear(32, 8)
    with SnapshotManager("p", store=tmp_path / "s", handle_signals=False) as m:
        assert m.restore(fresh) == 4
        assert [s.step for s in m.repo.catalog.snapshots("p", "default")] == [0, 2, 4]
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k])
    assert not (tmp_path / "s" / "catalog.db").exists()  # the index lives in PostgreSQL


def test_sizes_and_steps_beyond_32_bits_fit(pg_url: str) -> None:
    catalog = Catalog(pg_url)
    m = Manifest(project="big", job="j", step=3_000_000_000, parent="", created=utc_now(),
                 body="a" * 64, body_bytes=10, total_bytes=5 * 2**40, new_bytes=3 * 2**33,
                 tensors=1)
    catalog.add_snapshot(m, "b" * 64)
    got = catalog.latest("big", "j")
    catalog.close()
    assert got is not None and got.total_bytes == 5 * 2**40 and got.step == 3_000_000_000


def test_the_server_keeps_keys_and_audit_in_postgres(tmp_path: Path, pg_url: str) -> None:
    catalog = Catalog(pg_url)
    key, info = create_key(catalog, "team", "writer")
    got = authenticate(catalog, key)
    assert got is not None and (got.id, got.project, got.role) == (info.id, "team", "writer")
    assert authenticate(catalog, key + "x") is None
    with TestClient(create_app(str(tmp_path / "store"), pg_url)) as http:
        h = {"Authorization": f"Bearer {key}"}
        assert http.get("/v1/whoami", headers=h).json()["project"] == "team"
        assert http.put("/v1/projects/team/objects/chunks/aa/" + "aa" * 32, headers=h,
                        content=b"data").status_code == 200
        revoke_key(catalog, info.id)
        assert http.get("/v1/whoami", headers=h).status_code == 401
    actions = [e["action"] for e in audit_log(catalog, "team")]
    catalog.close()
    assert actions == ["apikey.revoke", "apikey.create"]
