"""Regression tests for defects found in review: each failed before its fix."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, SnapshotNotFound, StateHolder, StateMismatch, faults, knobs
from ciuic.chain.gc import _is_live, collect
from ciuic.chain.read import read_body
from ciuic.chain.repo import Repository
from ciuic.engine import unchanged
from ciuic.engine.own_thread import OwnThread
from ciuic.errors import CaptureError
from ciuic.format import layout, tree
from ciuic.format import manifest as mf
from ciuic.format.layout import GC_LOCK as LOCK_KEY
from ciuic.format.layout import chunk_key
from ciuic.manager import pipeline as snapshot_module
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
    path = store_dir / "objects" / layout.manifest_key("p", "g", info.id)
    data = path.read_bytes()
    assert b'"format":2' in data  # as written today; made a newer format than this reads:
    path.write_bytes(data.replace(b'"format":2', b'"format":3'))
    chunks_before = list(repo.store.list("chunks/"))
    result = collect(repo)
    assert "gc deletes nothing" in result.skipped
    assert list(repo.store.list("chunks/")) == chunks_before
    assert repo.store.has(layout.body_key("p", "g", info.body))


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
    (store_dir / "objects" / layout.manifest_key("p", "mm", gone.id)).unlink()
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


def test_young_temporaries_survive_gc(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "o")
    (tmp_path / "o" / ".tmp-young").write_bytes(b"a writer is using me")
    assert store.remove_temporaries(older_than_s=3600) == 0
    assert store.remove_temporaries(older_than_s=0) == 1


def test_dict_keys_of_equal_text_are_refused_and_old_bodies_with_them_restore(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """{0: a, "0": b} named two tensors "0": they shared a staging buffer (the snapshot held b
    twice) and a reader buffer (a restore gave b twice)."""
    a, b = torch.full((1000,), 1.0), torch.full((1000,), 2.0)
    with SnapshotManager("p", job="keys", store=store_dir, compression="off") as m:
        with pytest.raises(CaptureError, match=r"keys 0 and '0' of one dict have the same text"):
            m.save(1, s=StateHolder({0: a, "0": b}))
        assert m.latest() is None  # nothing was written
    # a body an earlier version wrote (synchronously, so with the right bytes) still restores
    monkeypatch.setattr(tree, "_check_distinct", lambda *_: None)
    with SnapshotManager("p", job="keys", store=store_dir, compression="off",
                         asynchronous=False) as m:
        m.save(1, s=StateHolder({0: a, "0": b}))
    for asynchronous in (True, False):  # async restores lend staging buffers (model only)
        with SnapshotManager("p", job="keys", store=store_dir,
                             asynchronous=asynchronous) as m:
            h = StateHolder()
            m.restore(s=h)
        assert torch.equal(h.state[0], a) and torch.equal(h.state["0"], b)


class KeepsExtraState(nn.Module):
    """A module whose ``set_extra_state`` keeps the tensor it is given (allowed by torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.table = torch.zeros(4096)

    def get_extra_state(self) -> torch.Tensor:
        return self.table

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.table = state


def test_a_restored_tensor_the_model_keeps_is_never_the_staging_buffer(store_dir: Path) -> None:
    """A restore reads the model into the staging buffers; a module that keeps the tensor then
    holds a staging buffer: the next snapshots compared the buffer with itself ("unchanged")
    and kept the old digests for new bytes."""
    kw: dict[str, Any] = {"store": store_dir, "compression": "off", "save_interval": None}
    first = KeepsExtraState()
    first.table.fill_(1.0)
    with SnapshotManager("p", job="keep", **kw) as m:
        m.save(1, first)
    model = KeepsExtraState()
    with SnapshotManager("p", job="keep", **kw) as m:
        m.restore(model)
        for step in (2, 3, 4):
            model.table.fill_(float(step))
            m.save(step, model)
            assert not any(buf.data_ptr() == model.table.data_ptr()
                           for buf in m._pipeline.staging._buffers.values())
        snapshots = m.repo.catalog.snapshots("p", "keep")
    assert len(snapshots) == 4
    for info in snapshots:
        fresh = KeepsExtraState()
        with SnapshotManager("p", job="keep", **kw) as m:
            m.restore(fresh, snapshot=info.id)
        assert float(fresh.table[0]) == float(info.step), info.step


def test_own_threads_and_copy_pools_work_in_a_forked_child() -> None:
    """A forked child has none of its parent's threads: a pool that believed it had an idle
    worker waited forever (the compression decider hung a child's first snapshot)."""
    own = OwnThread("ciuic-test-fork")
    assert own.run(lambda: 1) == 1
    a = np.ones(4 * 1024 * 1024, dtype=np.uint8)  # NumPy: torch's OpenMP hangs after a fork
    b = np.zeros_like(a)
    unchanged.copy_changed(a.ctypes.data, b.ctypes.data, a.size, 1 << 20, None)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if both work
        signal.alarm(20)
        c = np.zeros_like(a)
        unchanged.copy_changed(a.ctypes.data, c.ctypes.data, a.size, 1 << 20, None)
        os._exit(0 if own.run(lambda: 2) == 2 and bool(c.all()) else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")


def test_a_new_optimizer_that_reuses_an_id_still_waits_for_the_overlapped_copy(
        store_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    with SnapshotManager("p", job="ov", store=store_dir, save_interval=1, overlap=True,
                         compression="off") as m:
        old = torch.optim.SGD(model.parameters(), lr=1.0)
        m.step(1, model, old)
        m.wait()
        old_id = id(old)
        del old  # a new training phase, say
        opt = None
        for _ in range(1000):  # CPython soon gives a new object the freed one's address
            opt = torch.optim.SGD(model.parameters(), lr=1.0)
            if id(opt) == old_id:
                break
            opt = None
        if opt is None:
            pytest.skip("no new optimizer got the old one's id")
        faults.reload("stage.copy=sleep:0.5")  # a slow background copy
        try:
            m.step(2, model, opt)
            expected = model.weight.detach().clone()
            model.weight.grad = torch.ones_like(model.weight)
            opt.step()  # must wait for the copy of step 2's values
            m.wait()
        finally:
            faults.reload("")
        fresh = nn.Linear(256, 256)
        assert m.restore(fresh) == 2
    assert torch.equal(fresh.weight, expected)


def test_managers_closed_in_creation_order_leave_the_original_signal_handlers(
        store_dir: Path) -> None:
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # whatever ran earlier
    try:
        m1 = SnapshotManager("p", job="a", store=store_dir)
        m2 = SnapshotManager("p", job="b", store=store_dir)
        m1.close()
        m2.close()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert not any(getattr(signal.getsignal(s), "__self__", None) in (m1, m2)
                       for s in (signal.SIGINT, signal.SIGTERM))
        # a closed manager's handler, still called by someone's chain, passes the signal on
        with pytest.raises(KeyboardInterrupt):
            m1._signals._on_signal(signal.SIGINT, None)
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("same_manager", [False, True])
def test_a_chunk_a_restore_found_damaged_is_written_again_not_reused(
        store_dir: Path, same_manager: bool) -> None:
    """The latest snapshot's chunk was damaged on disk; the restore fell back to the one
    before, and training redid the step with the same bytes: that snapshot reused the damaged
    chunk as already stored, so it was damaged too, and so was every later one. In the manager
    that wrote it (a rollback mid-run) its chunk cache also said the chunk was stored."""
    kw: dict[str, Any] = {"store": store_dir, "compression": "off"}
    values = {1: torch.full((8192,), 1.0), 2: torch.full((8192,), 2.0)}
    first = SnapshotManager("p", job="dmg", **kw)
    for step, v in values.items():
        info = first.save(step, s=StateHolder({"x": v.clone()}))
    (d, n), = read_body(first.repo, info)[1]["s"]["x"]["$tensor"]["chunks"]
    path = store_dir / "objects" / chunk_key(d)
    path.write_bytes(path.read_bytes()[:-100])  # truncated
    if not same_manager:
        first.close()
    with first if same_manager else SnapshotManager("p", job="dmg", **kw) as m:
        assert m.restore(s=StateHolder()) == 1  # the damaged step 2 is skipped
        again = m.save(2, s=StateHolder({"x": values[2].clone()}))
        assert again.new_bytes == n  # written again, over the damaged copy
        for snap in (info, again):  # the old step-2 snapshot is whole again too
            h = StateHolder()
            m.restore(s=h, snapshot=snap.id)
            assert torch.equal(h.state["x"], values[2])


def test_an_interrupted_snapshot_is_logged_as_interrupted(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A second Ctrl-C during a snapshot logged "failed (); training continues" and then the
    process stopped."""
    model, opt = small()
    with SnapshotManager("p", job="int", store=store_dir) as m:
        m.save(1, model, opt)

        def interrupt(*_: object, **__: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(snapshot_module, "write_snapshot", interrupt)
        with caplog.at_level(logging.WARNING, "ciuic"), pytest.raises(KeyboardInterrupt):
            m.save(2, model, opt)
    text = caplog.text
    assert "snapshot at step 2 interrupted (KeyboardInterrupt); the latest snapshot is step 1" \
        in text and "training continues" not in text
    assert m.stats.last_error == "KeyboardInterrupt"
