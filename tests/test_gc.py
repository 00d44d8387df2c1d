"""Garbage collection (ciuic.chain.gc): it deletes nothing while a manifest is unreadable, and
judges a lock marker written from another PID namespace by its age (each failed before its
fix)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ciuic import SnapshotManager, knobs
from ciuic.chain.gc import _is_live, collect
from ciuic.chain.repo import Repository
from ciuic.format import layout
from ciuic.format.layout import GC_LOCK as LOCK_KEY
from ciuic.store import LocalStore
from tests.models import model_opt


def test_gc_deletes_nothing_while_a_manifest_is_unreadable(store_dir: Path) -> None:
    model, opt = model_opt(8, 4)
    with SnapshotManager("p", job="g", store=store_dir) as m:
        info = m.save(0, model, opt)
    repo = Repository.open(store_dir)
    path = store_dir / "objects" / layout.manifest_key("p", "g", info.id)
    data = path.read_bytes()
    assert b'"format":2' in data  # as written today; made a newer format than this reads:
    path.write_bytes(data.replace(b'"format":2', b'"format":3'))
    chunks_before = list(repo.store.list("chunks/"))
    result = collect(repo)
    assert "gc deletes nothing" in result.skipped
    assert list(repo.store.list("chunks/")) == chunks_before
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
