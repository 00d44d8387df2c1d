"""Which snapshot a job's latest, a step and a restore name: retention per lineage (a restarted
run is not pruned by an older run's higher steps), commit order rather than the clock, a
missing manifest, a pruned step (each failed before its fix)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ciuic import SnapshotManager, SnapshotNotFound
from ciuic.chain.repo import Repository
from ciuic.format import layout
from ciuic.format import manifest as mf
from tests.models import model_opt


def test_new_lineage_is_not_pruned_by_an_older_ones_higher_steps(store_dir: Path) -> None:
    model, opt = model_opt(8, 4)
    with SnapshotManager("p", job="lin", store=store_dir, keep_last=2) as m:
        for s in (30, 40, 50):
            m.save(s, model, opt)
    with SnapshotManager("p", job="lin", store=store_dir, keep_last=2) as m2:  # no restore()
        for s in (0, 10, 20):
            m2.save(s, model, opt)
        kept = sorted(s.step for s in m2.repo.catalog.snapshots("p", "lin"))
    assert kept == [10, 20, 40, 50]
    with SnapshotManager("p", job="lin", store=store_dir) as m3:
        assert m3.restore(model, opt) == 20  # the newest lineage is the latest

def test_latest_follows_commit_order_not_the_clock(store_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = model_opt(8, 4)
    with SnapshotManager("p", job="clk", store=store_dir) as m:
        m.save(100, model, opt)
        monkeypatch.setattr(mf, "utc_now", lambda: "2001-01-01T00:00:00.000000Z")
        m.save(200, model, opt)
    with SnapshotManager("p", job="clk", store=store_dir) as m2:
        assert m2.latest().step == 200  # type: ignore[union-attr]
        assert m2.restore(model, opt) == 200

def test_restore_falls_back_when_a_manifest_is_missing(store_dir: Path) -> None:
    model, opt = model_opt(8, 4)
    with SnapshotManager("p", job="mm", store=store_dir) as m:
        m.save(1, model, opt)
        gone = m.save(2, model, opt)
    (store_dir / "objects" / layout.manifest_key("p", "mm", gone.id)).unlink()
    with SnapshotManager("p", job="mm", store=store_dir) as m2:
        assert m2.restore(model, opt) == 1

def test_job_at_step_of_a_pruned_snapshot_says_pruned(store_dir: Path) -> None:
    model, opt = model_opt(8, 4)
    with SnapshotManager("p", job="pr", store=store_dir, keep_last=1) as m:
        m.save(1, model, opt)
        m.save(2, model, opt)
    with pytest.raises(SnapshotNotFound, match="was pruned"):
        Repository.open(store_dir).resolve("p/pr@1")
