"""Garbage collection (ciuic.chain.gc): it deletes nothing while a manifest is unreadable, and
judges a lock marker written from another PID namespace by its age (each failed before its
fix)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager, knobs
from ciuic.chain.gc import InflightSave, _is_live, collect
from ciuic.chain.read import chunk_refs, read_body
from ciuic.chain.repo import Repository
from ciuic.chain.retention import prune, prune_one
from ciuic.chain.verify import verify_job
from ciuic.chain.writer import ChunkCache, remove_unreferenced
from ciuic.format import layout
from ciuic.format.digest import digest
from ciuic.format.info import SnapshotInfo
from ciuic.format.layout import GC_LOCK as LOCK_KEY
from ciuic.store import LocalStore
from ciuic.words import counted
from tests.models import model_opt


@pytest.fixture(autouse=True)
def _chunk_objects() -> Iterator[None]:
    """These tests count and name chunk objects: every piece its own (gc of packs, and a
    damaged manifest's packs kept: tests/test_packs.py)."""
    with knobs.override(pack_bytes=0):
        yield


def test_gc_deletes_nothing_while_a_manifest_in_a_newer_format_may_reference_anything(
        store_dir: Path) -> None:
    """A manifest this ciuic cannot read but that may be intact (a newer format: here its
    hash holds, its "format" is unknown) may reference any chunk."""
    model, opt = model_opt(8, 4)
    with SnapshotManager("p", job="g", store=store_dir) as m:
        info = m.save(0, model, opt)
    repo = Repository.open(store_dir)
    path = store_dir / "objects" / layout.manifest_key("p", "g", info.id)
    m2 = repo.read_manifest("p", "g", info.id)
    newer = m2.encode().replace(b'"format":2', b'"format":9')
    assert newer != m2.encode()
    sid = digest(newer)
    path.rename(path.with_name(f"{sid}.json"))
    path.with_name(f"{sid}.json").write_bytes(newer)
    chunks_before = list(repo.store.list("chunks/"))
    orphan = layout.chunk_key("0" * 64)
    repo.store.put(orphan, b"an orphan")  # collected, were nothing damaged
    result = collect(repo)
    assert "gc deletes nothing" in result.skipped
    assert result.damaged == [layout.manifest_key("p", "g", sid)]
    assert not result.damage[0].movable  # may be intact: never quarantined
    assert "upgrade ciuic" in result.warning()
    assert list(repo.store.list("chunks/")) == sorted([*chunks_before, orphan])
    assert repo.store.has(layout.body_key("p", "g", info.body))


def test_markers_from_another_pid_namespace_are_judged_by_age(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "o")
    from ciuic.chain.runs import IDENTITY

    dead_pid = 2**22 + 7
    other_ns = {**IDENTITY, "pidns": "pid:[1]", "pid": dead_pid, "time": time.time()}
    store.put(LOCK_KEY, json.dumps(other_ns).encode())
    assert _is_live(store, LOCK_KEY, 60)  # a pid we cannot see may be alive elsewhere
    same_ns = {**IDENTITY, "pid": dead_pid, "time": time.time()}
    store.put(LOCK_KEY, json.dumps(same_ns).encode())
    assert not _is_live(store, LOCK_KEY, 60)  # ours, and that pid is gone
    old = {**other_ns, "time": time.time() - 3600}
    store.put(LOCK_KEY, json.dumps(old).encode())
    with knobs.override(gc_lock_stale_s=600):
        assert not _is_live(store, LOCK_KEY, knobs.get().gc_lock_stale_s)


# -- a damaged manifest (ciuic issue #42, item 1) ----------------------------------------------

def saved(store_dir: Path, steps: int, job: str = "j") -> list[SnapshotInfo]:
    """``steps`` snapshots of a model whose weights change at each: one new chunk each."""
    model, opt = model_opt(128, 128)
    infos = []
    with SnapshotManager("p", job=job, store=store_dir, compression="off") as m:
        for step in range(steps):
            with torch.no_grad():
                model.weight.add_(1.0)
            infos.append(m.save(step, model, opt))
    return infos


def chunks_of(repo: Repository, info: SnapshotInfo) -> set[str]:
    return {layout.chunk_key(d) for d in chunk_refs(read_body(repo, info)[1])}


def damage(store_dir: Path, info: SnapshotInfo) -> str:
    key = layout.manifest_key(info.project, info.job, info.id)
    (store_dir / "objects" / key).write_bytes(b"garbage\n")
    return key


def test_a_damaged_pruned_manifest_no_longer_stops_gc(store_dir: Path) -> None:
    """The issue's steps: prune to keep-last 3, damage a pruned snapshot's manifest. gc said
    "gc deletes nothing until `ciuic verify` is clean" and collected nothing, for good; it now
    collects everything the readable snapshots do not reference (a pruned snapshot's damaged
    manifest references nothing: its body is gone), says so at every gc, and `ciuic gc
    --quarantine` moves the manifest aside, after which gc and verify are clean."""
    infos = saved(store_dir, 6)
    repo = Repository.open(store_dir)
    kept = [chunks_of(repo, i) for i in infos[3:]]
    assert len(prune(repo, "p", "j", 3, None)) == 3
    bad = damage(store_dir, infos[1])
    for _ in range(2):  # said at every gc, not once
        result = collect(repo)
        assert not result.skipped and result.damaged == [bad]
        assert "gc kept nothing for them and collected the rest" in result.warning()
        assert "`ciuic gc --quarantine` moves the damaged ones aside" in result.warning()
    assert set(repo.store.list("chunks/")) == set().union(*kept)  # the pruned three's went
    report = verify_job(repo, "p", "j")
    assert [p.key for p in report.problems or []] == [bad, bad]  # itself, and its child's link
    result = collect(repo, quarantine_damaged=True)
    assert result.quarantined == [bad] and not result.damage and not result.warning()
    assert repo.store.get(layout.quarantine_key(bad)) == b"garbage\n"
    assert not repo.store.has(bad)
    report = verify_job(repo, "p", "j", deep=True)
    assert report.ok and report.quarantined == 1 and report.snapshots == 3, report.problems
    assert not collect(repo).damage


def test_a_damaged_manifest_keeps_the_body_no_readable_manifest_names(store_dir: Path) -> None:
    """A committed snapshot's manifest damaged: its body is still there, and no readable
    manifest names it; gc keeps that body and its chunks (the manifest may have been its), and
    collects a pruned snapshot's. Once the manifest is quarantined, the body and the chunks
    only it used go, and the catalog no longer lists the snapshot."""
    infos = saved(store_dir, 4)
    repo = Repository.open(store_dir)
    its = chunks_of(repo, infos[2])
    own = its - chunks_of(repo, infos[3])
    pruned_only = chunks_of(repo, infos[0]) - set().union(
        *(chunks_of(repo, i) for i in infos[1:]))
    assert own and pruned_only
    prune_one(repo, repo.catalog.get(infos[0].id))
    bad = damage(store_dir, infos[2])
    result = collect(repo)
    assert result.damaged == [bad] and result.kept_for_damage == len(own)
    assert f"gc kept the {counted(len(own), 'chunk')} they may reference" in result.warning()
    assert not any(repo.store.has(k) for k in pruned_only)
    assert all(repo.store.has(k) for k in own)
    assert repo.store.has(layout.body_key("p", "j", infos[2].body))
    result = collect(repo, quarantine_damaged=True)
    assert result.quarantined == [bad] and result.deleted_bodies == 1
    assert not any(repo.store.has(k) for k in own)
    assert infos[2].id not in repo.catalog.all_snapshot_ids()
    assert verify_job(repo, "p", "j", deep=True).ok


def test_a_damaged_manifest_whose_candidate_body_is_damaged_too_stops_gc_until_quarantined(
        store_dir: Path) -> None:
    """Where what a damaged manifest may reference cannot be read (the one body it may name is
    damaged too), gc deletes nothing, and says what ends it; --quarantine moves both aside."""
    infos = saved(store_dir, 3)
    repo = Repository.open(store_dir)
    prune_one(repo, repo.catalog.get(infos[0].id))
    bad = damage(store_dir, infos[1])
    body = layout.body_key("p", "j", infos[1].body)
    (store_dir / "objects" / body).write_bytes(b"{}")
    result = collect(repo)
    assert result.skipped and result.deleted_chunks == 0
    assert set(result.damaged) == {bad, body} and "gc deletes nothing" in result.warning()
    result = collect(repo, quarantine_damaged=True)
    assert set(result.quarantined) == {bad, body} and not result.skipped
    assert result.deleted_chunks == 2  # the pruned one's, and the quarantined one's own
    assert verify_job(repo, "p", "j", deep=True).ok


def test_training_warns_of_a_damaged_manifest_and_its_store_stops_growing(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A job with keep_last=2 in a store with a damaged manifest: retention's gc went on
    refusing silently and the store grew with every snapshot; it now collects, and warns once
    a run, with the command that ends it."""
    infos = saved(store_dir, 4, job="old")
    repo = Repository.open(store_dir)
    prune(repo, "p", "old", 2, None)
    damage(store_dir, infos[0])
    model, opt = model_opt(128, 128)
    with caplog.at_level(logging.WARNING, "ciuic"), SnapshotManager(
            "p", job="new", store=store_dir, keep_last=2, compression="off") as m:
        for step in range(8):
            with torch.no_grad():
                model.weight.add_(1.0)
            m.save(step, model, opt)
    said = [r.getMessage() for r in caplog.records if "retention's gc" in r.getMessage()]
    assert len(said) == 1, said
    assert f"ciuic --store {store_dir} gc --quarantine" in said[0]
    # the chunks of the two snapshots each job keeps, where the new job's 8 stayed before
    repo.sync_job("p", "new")
    live = [s for job in ("old", "new") for s in repo.catalog.snapshots("p", job)]
    assert len(live) == 4
    assert set(repo.store.list("chunks/")) == set().union(*(chunks_of(repo, s) for s in live))


def test_a_failed_snapshots_cleanup_spares_what_another_save_or_a_snapshot_uses(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The chunks a snapshot wrote before it failed on a full disk (issue #42, item 3) go only
    under gc's protocol: not while another save is in flight (it may have found them stored),
    and never one a committed snapshot references."""
    infos = saved(store_dir, 1)
    repo = Repository.open(store_dir)
    used = chunks_of(repo, infos[0])
    mine = layout.chunk_key("1" * 64)
    repo.store.put(mine, b"a chunk only the failed snapshot wrote")
    cache = ChunkCache()
    cache.digests.add("1" * 64)
    with caplog.at_level(logging.WARNING, "ciuic"), InflightSave(repo.store):
        remove_unreferenced(repo, {*used, mine}, cache)
    assert repo.store.has(mine) and "1 save in progress" in caplog.text
    assert "1" * 64 not in cache.digests  # no longer trusted to be stored
    remove_unreferenced(repo, {*used, mine}, cache)
    assert not repo.store.has(mine) and all(repo.store.has(k) for k in used)


def test_a_servers_gc_answer_carries_its_damage_back_to_the_client() -> None:
    """The server's gc route answers ``asdict(GcResult)`` as JSON; the client rebuilds it with
    the damage it found, so `ciuic gc` against a server warns as it does on a folder."""
    import dataclasses

    from ciuic.chain.gc import GcResult
    from ciuic.chain.references import Damage

    sent = GcResult(deleted_chunks=3, kept_for_damage=2,
                    damage=[Damage("jobs/p/j/manifests/ab.json", "not JSON", "ab")])
    got = GcResult.from_answer(json.loads(json.dumps(dataclasses.asdict(sent))))
    assert got == sent
    assert got.damaged == ["jobs/p/j/manifests/ab.json"]
    assert "gc --quarantine" in got.warning()
