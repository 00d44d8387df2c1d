"""SnapshotManager behaviour: triggers, chain, incremental bytes, retention, errors, fallbacks."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import typing
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from ciuic import ConfigurationError, RestoreError, SnapshotManager, SnapshotNotFound, faults, knobs
from ciuic.chain.gc import collect
from ciuic.chain.read import chunk_refs, read_body
from ciuic.chain.repo import Repository
from ciuic.format import layout
from ciuic.format.layout import chunk_key
from tests import models
from tests.helpers.stored import flip, stored_at

model_and_opt = partial(models.model_opt, 32, 64, 8, momentum=0.9)


def one_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 32)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_seed_code_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CIUIC_HOME")
    model, optimizer = model_and_opt()
    train_dataloader = [torch.randn(4, 32) for _ in range(5)]
    snapshot_manager = SnapshotManager(project_id="deepseek_v2", api_key="your_api_key",
                                       save_interval=2)
    for step, batch in enumerate(train_dataloader):
        loss = model(batch).sum()
        loss.backward()
        optimizer.step()
        snapshot_manager.step(step, model, optimizer)
    snapshot_manager.close()
    repo = Repository.open(tmp_path / ".ciuic")  # the embedded default location
    assert [s.step for s in repo.catalog.snapshots("deepseek_v2", "default")] == [0, 2, 4]


def test_step_triggers_by_interval_and_time(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="t", store=store_dir, save_interval=3) as m:
        saved = [s for s in range(10) if m.step(s, model, opt)]
    assert saved == [0, 3, 6, 9]
    with SnapshotManager("p", job="time", store=store_dir, save_interval=None,
                         time_interval_s=0.05) as m:
        assert not m.step(0, model, opt)
        time.sleep(0.06)
        assert m.step(1, model, opt)
        assert not m.step(2, model, opt)


def test_chain_links_parents_and_restore_returns_step(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="c", store=store_dir, save_interval=1) as m:
        infos = [m.save(s, model, opt) for s in range(3)]
        assert m.latest() == m.repo.catalog.get(infos[-1].id)
    assert infos[0].parent == ""
    assert infos[1].parent == infos[0].id and infos[2].parent == infos[1].id
    with SnapshotManager("p", job="c", store=store_dir) as m2:
        assert m2.restore(model, opt) == 2
        assert m2.save(3, model, opt).parent == infos[2].id  # the chain continues
    with SnapshotManager("p", job="empty", store=store_dir) as m3:
        assert m3.restore(model, opt) is None


def test_unchanged_tensors_are_not_written_again(store_dir: Path) -> None:
    torch.manual_seed(0)
    frozen = nn.Linear(1024, 1024)  # 4 MiB, never trained
    head = nn.Linear(1024, 4)
    model = nn.Sequential(frozen, head)
    frozen.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    with knobs.override(chunk_bytes=1 << 20), SnapshotManager("p", job="inc",
                                                                store=store_dir) as m:
        first = m.save(0, model, opt)
        loss = model(torch.randn(2, 1024)).sum()
        loss.backward()
        opt.step()
        second = m.save(1, model, opt)
    assert first.new_bytes >= 4 * 1024 * 1024
    assert second.total_bytes == first.total_bytes
    assert second.new_bytes < 64 * 1024  # only the head (and RNG state) changed
    assert second.new_bytes > 4 * 1024 * 4  # the head's weight did change


def test_identical_tensors_in_one_snapshot_are_stored_once(store_dir: Path) -> None:
    same = torch.randn(512, 512)  # 1 MiB, referenced twice (tied weights) and copied once

    class Tied:
        def state_dict(self) -> dict[str, torch.Tensor]:
            return {"embed": same, "head": same, "copy": same.clone()}

    with knobs.override(chunk_bytes=256 * 1024), SnapshotManager("p", job="tied",
                                                                   store=store_dir) as m:
        info = m.save(0, tied=Tied())
    assert info.total_bytes >= 3 * same.numel() * 4
    assert same.numel() * 4 <= info.new_bytes < 1.1 * same.numel() * 4
    chunks = list(Repository.open(store_dir).store.list("chunks/"))
    assert len(chunks) <= 4 + 4  # 4 pieces + RNG state chunks


def test_retention_orders_steps_numerically(store_dir: Path) -> None:
    model, opt = model_and_opt()
    steps = [9800, 9900, 10000, 10100]
    with SnapshotManager("p", job="r", store=store_dir, keep_last=2) as m:
        for s in steps:
            m.save(s, model, opt)
        kept = [s.step for s in m.repo.catalog.snapshots("p", "r")]
        pruned = [s.step for s in m.repo.catalog.snapshots("p", "r", status="pruned")]
    assert kept == [10000, 10100]
    assert pruned == [9800, 9900]


def test_keep_every_and_keep_last_one(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="k", store=store_dir, keep_last=1, keep_every=100) as m:
        for s in (50, 100, 150, 200, 250):
            m.save(s, model, opt)
        kept = [s.step for s in m.repo.catalog.snapshots("p", "k")]
    assert kept == [100, 200, 250]
    with SnapshotManager("p", job="one", store=store_dir, keep_last=1) as m:
        m.save(5, model, opt)
        assert [s.step for s in m.repo.catalog.snapshots("p", "one")] == [5]
        assert m.restore(model, opt) == 5


def test_pruned_snapshots_keep_the_chain_and_free_chunks(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="g", store=store_dir, keep_last=1) as m:
        first = m.save(0, model, opt)
        _, states = read_body(m.repo, first)
        old_chunks = set(chunk_refs(states))
        one_step(model, opt)
        m.save(1, model, opt)
        repo = m.repo
        assert repo.store.has(layout.manifest_key("p", "g", first.id))  # the link stays
        assert not repo.store.has(layout.body_key("p", "g", first.body))
        for d in old_chunks:
            if d not in chunk_refs(read_body(repo, m.latest())[1]):  # type: ignore[arg-type]
                assert not repo.store.has(chunk_key(d)), "gc should have freed it"


def test_gc_waits_for_saves_in_progress(repo: Repository) -> None:
    from ciuic.chain.gc import InflightSave

    repo.store.put("chunks/ab/" + "ab" * 32, b"orphan")
    with InflightSave(repo.store):
        result = collect(repo, wait_s=0.1)
        assert result.skipped.startswith("1 save in progress")
        assert repo.store.has("chunks/ab/" + "ab" * 32)
    result = collect(repo)
    assert result.deleted_chunks == 1 and not result.skipped


def test_step_failure_does_not_stop_training(store_dir: Path, caplog: pytest.LogCaptureFixture
                                             ) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="f", store=store_dir, save_interval=1,
                         asynchronous=False) as m:
        assert m.step(0, model, opt)
        faults.reload("body.put=raise")
        with caplog.at_level(logging.ERROR, logger="ciuic"):
            assert not m.step(1, model, opt)
        assert "snapshot at step 1 failed" in caplog.text and "latest snapshot is still step 0" \
            in caplog.text
        assert "(1 failure in a row)" in caplog.text  # not "failure(s)" (issue 30)
        assert m.stats.failures == 1
        faults.reload("")
        assert m.latest().step == 0  # type: ignore[union-attr]
        assert m.step(2, model, opt)
    with SnapshotManager("p", job="fa", store=store_dir, save_interval=1) as ma:  # async
        assert ma.step(0, model, opt)
        ma.wait()
        faults.reload("body.put=raise")
        assert ma.step(1, model, opt)  # started: staged, then failed in the background
        ma.wait()
        assert ma.stats.failures == 1 and "injected" in ma.stats.last_error
        faults.reload("")
        assert ma.latest().step == 0  # type: ignore[union-attr]
    with pytest.raises(Exception, match="injected"):
        faults.reload("manifest.create=raise")
        with SnapshotManager("p", job="f2", store=store_dir) as m2:
            m2.save(0, model, opt)  # save() raises; step() would not


def test_damaged_latest_falls_back_with_a_warning(store_dir: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="d", store=store_dir) as m:
        m.save(1, model, opt)
        one_step(model, opt)
        bad = m.save(2, model, opt)
        _, states = read_body(m.repo, bad)
        ref = next(iter(chunk_refs(states).values()))
        victim = chunk_key(ref.digest)
    flip(store_dir, ref, stored_at(store_dir, ref)[2] - 1, 1)
    model2, opt2 = model_and_opt(seed=3)
    with caplog.at_level(logging.WARNING, logger="ciuic"), SnapshotManager(
            "p", job="d", store=store_dir) as m2:
        assert m2.restore(model2, opt2) == 1
    assert "Snapshot at step 2" in caplog.text and victim in caplog.text
    assert "falling back" in caplog.text


def test_no_loadable_snapshot_refuses_to_start_from_scratch(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="x", store=store_dir) as m:
        info = m.save(1, model, opt)
    (store_dir / "objects" / layout.body_key("p", "x", info.body)).write_bytes(b"{}")
    with SnapshotManager("p", job="x", store=store_dir) as m2, pytest.raises(
            RestoreError, match=r"none could be\s+restored") as e:
        m2.restore(model, opt)
    assert "refusing to start from scratch" in str(e.value)


def test_restart_without_restore_warns_and_keeps_chain(store_dir: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="w", store=store_dir) as m:
        old = m.save(50, model, opt)
    with caplog.at_level(logging.WARNING, logger="ciuic"), SnapshotManager(
            "p", job="w", store=store_dir, save_interval=1) as m2:
        m2.step(0, model, opt)
    assert "it is NOT resuming" in caplog.text and "latest at step 50" in caplog.text
    snaps = Repository.open(store_dir).catalog.snapshots("p", "w")
    assert [s.step for s in snaps] == [50, 0]
    assert snaps[1].parent == ""  # a new lineage: the old snapshot is not its parent
    assert snaps[0].id == old.id


def test_interruption_is_detected_from_the_previous_run(store_dir: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    model, opt = model_and_opt()
    m = SnapshotManager("p", job="i", store=store_dir, save_interval=1)
    m.step(0, model, opt)
    m.wait()
    m._session.record_end("signal:SIGTERM")  # as the signal path records it
    with caplog.at_level(logging.INFO, logger="ciuic"), SnapshotManager(
            "p", job="i", store=store_dir) as m2:
        assert m2.interrupted
        m2.restore(model, opt)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("Detected training interruption at step 0")
    assert "stopped by SIGTERM" in lines[0]
    assert lines[1] == "Searching for latest snapshot..."
    assert lines[2].startswith("Found snapshot at step 0, timestamp: ")
    assert lines[3].startswith("Loading snapshot from ")
    assert lines[4:] == ["Loading model state...", "Loading optimizer state...",
                         "Resuming training at step 1"]
    with SnapshotManager("p", job="i", store=store_dir) as m3:
        assert not m3.interrupted  # m2 closed cleanly
        kinds = [(e.kind, e.detail) for e in reversed(m3.repo.catalog.events("p", "i"))]
    assert [k for k, _ in kinds] == ["start", "snapshot", "end", "start", "restore", "end",
                                     "start"]
    assert kinds[2][1] == "signal:SIGTERM" and kinds[5][1] == "clean"


def test_lost_catalog_is_rebuilt_from_the_store(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="cat", store=store_dir, keep_last=2) as m:
        ids = [m.save(s, model, opt).id for s in range(4)]
    before = Repository.open(store_dir).catalog.snapshots("p", "cat", status=None)
    (store_dir / "catalog.db").unlink()
    for extra in ("catalog.db-wal", "catalog.db-shm"):
        (store_dir / extra).unlink(missing_ok=True)
    repo = Repository.open(store_dir)
    assert repo.catalog.snapshots("p", "cat", status=None) == []
    counts = repo.reindex()
    assert counts == {"snapshots": 2, "pruned": 2, "damaged": 0, "removed": 0}
    after = repo.catalog.snapshots("p", "cat", status=None)
    assert after == before
    assert [s.id for s in after] == ids


def test_references_resolve_and_bad_ones_explain(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("proj", job="ref", store=store_dir) as m:
        a = m.save(9900, model, opt)
        b = m.save(10000, model, opt)
    repo = Repository.open(store_dir)
    assert repo.resolve(b.id).id == b.id
    assert repo.resolve(a.id[:10]).id == a.id
    assert repo.resolve("proj/ref@9900").id == a.id
    assert repo.resolve("ref@latest").id == b.id
    with pytest.raises(SnapshotNotFound, match=r"no snapshot at step 5 .*9900, 10000"):
        repo.resolve("proj/ref@5")
    with pytest.raises(SnapshotNotFound, match="no job named 'nojob'"):
        repo.resolve("nojob@latest")
    with pytest.raises(SnapshotNotFound, match="no snapshot ID starts with"):
        repo.resolve("ffff0000")
    with pytest.raises(SnapshotNotFound, match="is neither a job of this store nor a snapshot"):
        repo.resolve("what?")
    with SnapshotManager("proj", job="ref", store=store_dir) as m2, pytest.raises(
            SnapshotNotFound, match="step 77"):
        m2.restore(model, opt, snapshot="proj/ref@77")


@pytest.mark.parametrize("kwargs, message", [
    ({"project_id": "bad name"}, "invalid project name"),
    ({"project_id": "p", "job": "../x"}, "invalid job name"),
    ({"project_id": "p", "keep_last": 0}, "keep_last must be an integer >= 1"),
    ({"project_id": "p", "time_interval_s": -1}, "time_interval_s must be a positive"),
    ({"project_id": "p", "save_interval": 2.5}, "save_interval must be"),
])
def test_bad_arguments_are_explained(store_dir: Path, kwargs: dict[str, object],
                                     message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        SnapshotManager(store=store_dir, **kwargs)  # type: ignore[arg-type]


def test_the_signature_is_the_declared_options_and_help_documents_each() -> None:
    """SnapshotManager's spelled-out signature is ManagerOptions' (where each option is declared
    and documented): the same names in the same order, kinds, defaults and types; an option
    added to one side only fails here. help() lists every option with its documentation."""
    from ciuic.manager.config import ManagerOptions

    ours = inspect.signature(SnapshotManager).parameters
    declared = inspect.signature(ManagerOptions).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in declared.values()]
    assert list(ours)[:4] == ["project_id", "api_key", "save_interval", "encryption"]
    hints, types = typing.get_type_hints(SnapshotManager.__init__), typing.get_type_hints(
        ManagerOptions)
    assert {n: hints[n] for n in ours} == {n: types[n] for n in declared}
    assert hints["return"] is type(None)
    doc = SnapshotManager.__doc__ or ""
    for f in dataclasses.fields(ManagerOptions):
        first = " ".join(f.metadata["doc"].split())[:30]
        assert first and f"\n        {f.name}: {first}" in doc, f.name


def test_missing_extra_and_reserved_names(store_dir: Path) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="e", store=store_dir) as m:
        m.save(0, model, opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        with pytest.raises(Exception, match=r"no state for scheduler \(it has"):
            m.restore(model, opt, scheduler=sched)
        with pytest.raises(ConfigurationError, match="reserved"):
            m.save(1, model, opt, rng=1)


def test_damaged_catalog_is_moved_aside_and_rebuilt(store_dir: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    model, opt = model_and_opt()
    with SnapshotManager("p", job="dmg", store=store_dir) as m:
        ids = [m.save(s, model, opt).id for s in range(3)]
    for extra in ("catalog.db-wal", "catalog.db-shm"):
        (store_dir / extra).unlink(missing_ok=True)
    (store_dir / "catalog.db").write_bytes(b"this is not a database" * 100)
    with caplog.at_level(logging.WARNING, logger="ciuic"), SnapshotManager(
            "p", job="dmg", store=store_dir) as m2:
        assert [s.id for s in m2.repo.catalog.snapshots("p", "dmg")] == ids
        assert m2.restore(model, opt) == 2
    assert "the catalog was damaged" in caplog.text and "nothing is lost" in caplog.text
    assert list(store_dir.glob("catalog.db.damaged-*"))


def test_processes_opening_a_fresh_catalog_at_once_never_call_it_damaged(
        tmp_path: Path) -> None:
    """Ranks of one job (or `ciuic ls` beside a starting job) create the same SQLite catalog at
    the same moment: a busy or half-created schema is a race to wait out, not damage."""
    import subprocess
    import sys

    code = ("import sys, time; from ciuic.catalog import Catalog; "
            "time.sleep(max(0.0, float(sys.argv[2]) - time.time())); "
            "c = Catalog(sys.argv[1]); print(c.recreated_from); c.close()")
    for round_ in range(2):
        db = tmp_path / f"r{round_}" / "catalog.db"
        start = time.time() + 1.5  # every process past its imports before any opens the file
        procs = [subprocess.Popen([sys.executable, "-c", code, f"sqlite:///{db}", str(start)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(6)]
        outs = [p.communicate(timeout=60) for p in procs]
        assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
        assert [o.strip() for o, _ in outs] == ["None"] * 6
        assert not list(db.parent.glob("*.damaged-*"))


def test_writers_creating_one_project_at_once_all_succeed(tmp_path: Path) -> None:
    """Many catalog connections (server threads, ranks, clients) creating the same project and
    jobs at the same moment: a unique-constraint race, not an error."""
    import threading

    from ciuic.catalog import Catalog

    url = f"sqlite:///{tmp_path / 'c.db'}"
    Catalog(url).close()
    errors: list[str] = []
    barrier = threading.Barrier(16)

    def writer(i: int) -> None:
        c = Catalog(url)
        barrier.wait()
        try:
            c.ensure_job("proj", f"job{i % 3}")
        except Exception as e:
            errors.append(repr(e))
        finally:
            c.close()

    for _ in range(3):
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    c = Catalog(url)
    assert errors == [] and sorted(j.job for j in c.jobs()) == ["job0", "job1", "job2"]
    c.close()
