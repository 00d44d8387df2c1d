"""Regression tests for defects found in review: each failed before its fix."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, SnapshotNotFound, StateMismatch, knobs
from ciuic import manifest as mf
from ciuic import snapshot as snapshot_module
from ciuic.gc import LOCK_KEY, _is_live, collect
from ciuic.repo import Repository
from ciuic.store import LocalStore


def small() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_numpy_scalars_as_metrics_and_state_round_trip(store_dir: Path) -> None:
    class Holder:
        def __init__(self) -> None:
            self.s: dict[str, object] = {"best": np.float64(0.5), "f32": np.float32(0.1),
                                         "n": np.int16(-3), "flag": np.bool_(True)}

        def state_dict(self) -> dict[str, object]:
            return self.s

        def load_state_dict(self, s: dict[str, object]) -> None:
            self.s = s

    model, opt = small()
    with SnapshotManager("p", job="np", store=store_dir, keep_last=1, save_interval=1) as m:
        assert m.step(0, model, opt, holder=Holder(), loss=np.float64(0.25))
        assert m.step(1, model, opt, holder=Holder(), loss=np.float32(0.125))
        m.wait()
        assert m.stats.failures == 0
        assert m.latest().metrics == {"loss": 0.125}  # type: ignore[union-attr]
    h = Holder()
    h.s = {}
    with SnapshotManager("p", job="np", store=store_dir) as m2:
        assert m2.restore(model, opt, holder=h) == 1
    assert h.s["f32"] == np.float32(0.1) and type(h.s["f32"]) is np.float32
    assert type(h.s["best"]) is np.float64 and type(h.s["n"]) is np.int16
    assert h.s["flag"] == np.bool_(True)


def test_gc_deletes_nothing_while_a_manifest_is_unreadable(store_dir: Path) -> None:
    model, opt = small()
    with SnapshotManager("p", job="g", store=store_dir) as m:
        info = m.save(0, model, opt)
    repo = Repository.open(store_dir)
    path = store_dir / "objects" / mf.manifest_key("p", "g", info.id)
    path.write_bytes(path.read_bytes().replace(b'"format":1', b'"format":2'))
    chunks_before = list(repo.store.list("chunks/"))
    result = collect(repo)
    assert "gc deletes nothing" in result.skipped
    assert list(repo.store.list("chunks/")) == chunks_before
    assert repo.store.has(mf.body_key("p", "g", info.body))


def test_new_lineage_is_not_pruned_by_an_older_ones_higher_steps(store_dir: Path) -> None:
    model, opt = small()
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
    model, opt = small()
    with SnapshotManager("p", job="clk", store=store_dir) as m:
        m.save(100, model, opt)
        monkeypatch.setattr(mf, "utc_now", lambda: "2001-01-01T00:00:00.000000Z")
        m.save(200, model, opt)
    with SnapshotManager("p", job="clk", store=store_dir) as m2:
        assert m2.latest().step == 200  # type: ignore[union-attr]
        assert m2.restore(model, opt) == 200


def test_failed_extra_leaves_model_untouched(store_dir: Path) -> None:
    from ciuic import ResumableSampler

    model, opt = small()
    with SnapshotManager("p", job="ex", store=store_dir) as m:
        m.save(0, model, opt, sampler=ResumableSampler(10), cfg=5)
    other, opt2 = small()
    with torch.no_grad():
        other.weight.fill_(7.0)
    with SnapshotManager("p", job="ex", store=store_dir) as m2:
        with pytest.raises(Exception, match="no load_state_dict"):
            m2.restore(other, opt2, cfg=5)
        with pytest.raises(StateMismatch, match=r"sampler.load_state_dict\(\) rejected"):
            m2.restore(other, opt2, sampler=ResumableSampler(11))
    assert torch.all(other.weight == 7.0)


def test_unexpected_errors_in_a_save_never_stop_training(store_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    model, opt = small()

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("surprise")

    for asynchronous in (False, True):
        with SnapshotManager("p", job=f"rt{asynchronous}", store=store_dir, save_interval=1,
                             asynchronous=asynchronous) as m:
            assert m.step(0, model, opt, conj=torch.randn(3, dtype=torch.complex64).conj())
            m.wait()
            assert m.stats.failures == 0
            with monkeypatch.context() as mp, caplog.at_level(logging.ERROR, logger="ciuic"):
                mp.setattr(snapshot_module, "write_snapshot", boom)
                started = m.step(1, model, opt)
                m.wait()
            assert started is asynchronous  # async: started, then failed in the background
            assert "surprise" in caplog.text and m.stats.failures == 1


def test_restore_falls_back_when_a_manifest_is_missing(store_dir: Path) -> None:
    model, opt = small()
    with SnapshotManager("p", job="mm", store=store_dir) as m:
        m.save(1, model, opt)
        gone = m.save(2, model, opt)
    (store_dir / "objects" / mf.manifest_key("p", "mm", gone.id)).unlink()
    with SnapshotManager("p", job="mm", store=store_dir) as m2:
        assert m2.restore(model, opt) == 1


def test_job_at_step_of_a_pruned_snapshot_says_pruned(store_dir: Path) -> None:
    model, opt = small()
    with SnapshotManager("p", job="pr", store=store_dir, keep_last=1) as m:
        m.save(1, model, opt)
        m.save(2, model, opt)
    with pytest.raises(SnapshotNotFound, match="was pruned"):
        Repository.open(store_dir).resolve("p/pr@1")


def test_markers_from_another_pid_namespace_are_judged_by_age(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "o")
    from ciuic.gc import _IDENTITY

    dead_pid = 2**22 + 7
    other_ns = {**_IDENTITY, "pidns": "pid:[1]", "pid": dead_pid, "time": time.time()}
    store.put(LOCK_KEY, json.dumps(other_ns).encode())
    assert _is_live(store, LOCK_KEY, 60)  # a pid we cannot see may be alive elsewhere
    same_ns = {**_IDENTITY, "pid": dead_pid, "time": time.time()}
    store.put(LOCK_KEY, json.dumps(same_ns).encode())
    assert not _is_live(store, LOCK_KEY, 60)  # ours, and that pid is gone
    old = {**other_ns, "time": time.time() - 3600}
    store.put(LOCK_KEY, json.dumps(old).encode())
    with knobs.override(gc_lock_stale_s=600):
        assert not _is_live(store, LOCK_KEY, knobs.get().gc_lock_stale_s)


def test_young_temporaries_survive_gc(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "o")
    (tmp_path / "o" / ".tmp-young").write_bytes(b"a writer is using me")
    assert store.remove_temporaries(older_than_s=3600) == 0
    assert store.remove_temporaries(older_than_s=0) == 1
