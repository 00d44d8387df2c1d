"""Storage faults and hostile input: transient errors, a full disk, a hanging store, tampering,
a chunk a restore found damaged (written again, not reused)."""

from __future__ import annotations

import errno
import logging
import pickle
import random
import threading
import time
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ciuic import RestoreError, SnapshotManager, StateHolder, knobs
from ciuic.chain.read import read_body
from ciuic.chain.repo import Repository
from ciuic.chain.verify import verify_job
from ciuic.format import layout
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.layout import chunk_key
from ciuic.store import MemoryStore, Store
from ciuic.store.base import Data
from tests import models
from tests.helpers.stored import truncate


@pytest.fixture
def chunk_objects() -> Iterator[None]:
    """Every piece its own chunk object (with packs, small pieces share objects)."""
    with knobs.override(pack_bytes=0):
        yield


class FaultyStore(Store):
    """A memory store whose chunk writes fail (or hang) while ``mode`` says so."""

    def __init__(self, name: str) -> None:
        self.inner = MemoryStore(name)
        self.url = f"faulty://{name}"
        self.mode = "ok"  # ok | flaky | full | hang
        self.failures = 0
        self.failed: list[str] = []  # the keys of the failed writes ("full"), in order
        self.release = threading.Event()

    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        if key.startswith(("chunks/", "packs/")):
            if self.mode == "flaky" and self.failures % 2 == 0:
                self.failures += 1
                raise OSError(errno.EIO, "transient I/O error")
            if self.mode == "full":
                self.failures += 1
                self.failed.append(key)
                raise OSError(errno.ENOSPC, "No space left on device")
            if self.mode == "hang":
                self.failures += 1
                self.release.wait(30)
        self.inner.put(key, data, durable=durable)

    def create(self, key: str, data: Data) -> bool:
        return self.inner.create(key, data)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def has(self, key: str) -> bool:
        return self.inner.has(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


model_opt = partial(models.model_opt, 300, 300)


def bump(model: nn.Module) -> None:
    with torch.no_grad():
        model.weight.add_(1.0)


def test_transient_errors_are_retried(tmp_path: Path) -> None:
    store = FaultyStore("flaky")
    model, opt = model_opt()
    with knobs.override(store_backoff_s=0.01), SnapshotManager(
            "p", job="flaky", store=store, save_interval=1) as m:
        store.mode = "flaky"
        assert m.step(0, model, opt)
        m.wait()
        assert m.stats.failures == 0 and store.failures >= 1
        assert m.latest().step == 0  # type: ignore[union-attr]


def test_disk_full_fails_loudly_training_goes_on_previous_survives(
        caplog: pytest.LogCaptureFixture) -> None:
    store = FaultyStore("full")
    model, opt = model_opt()
    with knobs.override(store_backoff_s=0.01), SnapshotManager(
            "p", job="full", store=store, save_interval=1) as m:
        assert m.step(0, model, opt)
        m.wait()
        store.mode = "full"
        bump(model)
        assert m.step(1, model, opt)  # staged; the write fails in the background
        m.wait()
        assert m.stats.failures == 1
        assert "no space left" in m.stats.last_error and "ciuic gc" in m.stats.last_error
        # a full disk is not retried: each object tried once (a chunk and a pack may be
        # written side by side)
        assert store.failures >= 1 and len(set(store.failed)) == len(store.failed)
        assert "snapshot at step 1 failed" in caplog.text
        assert m.latest().step == 0  # type: ignore[union-attr]
        store.mode = "ok"
        bump(model)
        assert m.step(2, model, opt)
        m.wait()
        assert m.latest().step == 2  # type: ignore[union-attr]


def test_a_hanging_store_times_out_and_training_goes_on() -> None:
    store = FaultyStore("hang")
    model, opt = model_opt()
    with knobs.override(store_timeout_s=0.3, store_attempts=2, store_backoff_s=0.01):
        m = SnapshotManager("p", job="hang", store=store, save_interval=1, asynchronous=False)
        assert m.step(0, model, opt)
        store.mode = "hang"
        bump(model)
        t0 = time.perf_counter()
        assert m.step(1, model, opt) is False  # synchronous: failed, after bounded time
        elapsed = time.perf_counter() - t0
        assert elapsed < 5, elapsed
        assert "did not finish in 0.3 s" in m.stats.last_error
        assert m.latest().step == 0  # type: ignore[union-attr]
        store.release.set()
        store.mode = "ok"
        bump(model)
        assert m.step(2, model, opt)
        m.close()


class _Boom:
    def __reduce__(self) -> tuple[object, ...]:
        return (Path.touch, (Path(_MARKER),))


_MARKER = "/tmp/ciuic-test-pickle-was-executed"


def test_a_malicious_pickle_is_never_executed(store_dir: Path) -> None:
    Path(_MARKER).unlink(missing_ok=True)
    model, opt = model_opt()
    with SnapshotManager("p", job="evil", store=store_dir) as m:
        info = m.save(1, model, opt)
    payload = pickle.dumps({"weights": _Boom()})
    torch_file = store_dir / "evil.pt"
    torch.save({"x": _Boom()}, torch_file)  # a torch file that would run code on load
    objects = store_dir / "objects"
    for key in (layout.body_key("p", "evil", info.body), layout.manifest_key("p", "evil", info.id)):
        (objects / key).write_bytes(payload)
    for chunk in (objects / "chunks").rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(torch_file.read_bytes())
    with SnapshotManager("p", job="evil", store=store_dir) as m2, pytest.raises(RestoreError):
        m2.restore(model, opt)
    report = verify_job(Repository.open(store_dir), "p", "evil", deep=True)
    assert not report.ok
    assert not Path(_MARKER).exists(), "unpickling ran code"


def _flip_random_bits(paths: list[Path], rng: random.Random) -> None:
    for path in paths:
        data = bytearray(path.read_bytes())
        bit = rng.randrange(len(data) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(data))


@pytest.fixture
def flip_store(store_dir: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    opt = torch.optim.Adam(model.parameters())
    with knobs.override(chunk_bytes=1024, inline_max_bytes=64), SnapshotManager(
            "p", job="flip", store=store_dir, save_interval=1) as m:
        for s in range(4):
            loss = model(torch.randn(2, 64)).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            m.step(s, model, opt)
    return store_dir / "objects"


def test_100_random_bit_flips_in_chunks_are_detected_with_their_snapshots(
        flip_store: Path, store_dir: Path) -> None:
    chunks = sorted(p for p in (flip_store / "chunks").rglob("*") if p.is_file())
    assert len(chunks) >= 200
    victims = random.Random(7).sample(chunks, 100)
    _flip_random_bits(victims, random.Random(8))
    report = verify_job(Repository.open(store_dir), "p", "flip", deep=True)
    problems = report.problems or []
    for v in victims:
        key = str(v.relative_to(flip_store))
        users = {p.snapshot for p in problems if p.key == key}
        assert users and "" not in users, f"{key}: detected by {users}"
    assert {p.key for p in problems} == {str(v.relative_to(flip_store)) for v in victims}


def test_random_bit_flips_in_manifests_and_bodies_are_detected(flip_store: Path,
                                                               store_dir: Path) -> None:
    meta = sorted(p for p in (flip_store / "jobs").rglob("*.json") if p.is_file())
    victims = random.Random(9).sample(meta, 5)
    _flip_random_bits(victims, random.Random(10))
    report = verify_job(Repository.open(store_dir), "p", "flip", deep=True)
    named = {p.key for p in report.problems or []}
    assert {str(v.relative_to(flip_store)) for v in victims} <= named


@pytest.mark.parametrize("failpoint", ["chunk.put", "chunks.sync", "body.put",
                                       "manifest.create"])
def test_an_io_error_at_each_write_step_keeps_the_previous_snapshot(
        store_dir: Path, failpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    from ciuic import faults

    model, opt = model_opt()
    with SnapshotManager("p", job="err", store=store_dir, save_interval=1,
                         asynchronous=False) as m:
        assert m.step(0, model, opt)
        bump(model)
        faults.reload(f"{failpoint}=raise")
        assert m.step(1, model, opt) is False  # training goes on
        faults.reload("")
        assert f"failpoint {failpoint}" in m.stats.last_error
        assert "snapshot at step 1 failed" in caplog.text
        assert m.latest().step == 0  # type: ignore[union-attr]
        bump(model)
        assert m.step(2, model, opt)
    fresh, fresh_opt = model_opt()
    with SnapshotManager("p", job="err", store=store_dir) as m2:
        assert m2.restore(fresh, fresh_opt) == 2
    assert torch.equal(fresh.weight, model.weight)


def test_a_truncated_chunk_falls_back_to_the_previous_snapshot(
        store_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from ciuic.chain.read import read_body

    model, opt = model_opt()
    with SnapshotManager("p", job="trunc", store=store_dir) as m:
        m.save(1, model, opt)
        bump(model)
        second = m.save(2, model, opt)
        _, states = read_body(m.repo, second)
    # changed by bump(): not shared
    ref = TensorDescriptor.from_json(states["model"]["weight"]["$tensor"]).chunks[0]
    truncate(store_dir, ref, 100)
    fresh, fresh_opt = model_opt()
    with caplog.at_level(logging.WARNING, logger="ciuic"), SnapshotManager(
            "p", job="trunc", store=store_dir) as m2:
        assert m2.restore(fresh, fresh_opt) == 1
    assert "truncated" in caplog.text or "length mismatch" in caplog.text


def test_gc_during_a_save_never_deletes_what_the_save_references(store_dir: Path) -> None:
    from ciuic import faults
    from ciuic.chain.gc import collect

    model, opt = model_opt()
    with SnapshotManager("p", job="race", store=store_dir, save_interval=1, keep_last=1) as m:
        assert m.step(0, model, opt)
        m.wait()
        bump(model)
        faults.reload("chunk.put=sleep:0.1")
        assert m.step(1, model, opt)  # in flight for a while
        time.sleep(0.05)
        results = [collect(Repository.open(store_dir), wait_s=0.0) for _ in range(3)]
        faults.reload("")
        m.wait()
        assert m.stats.failures == 0
    assert all("in progress" in r.skipped for r in results if r.skipped)
    report = verify_job(Repository.open(store_dir), "p", "race", deep=True)
    assert report.ok, report.problems
    fresh, fresh_opt = model_opt()
    with SnapshotManager("p", job="race", store=store_dir) as m2:
        assert m2.restore(fresh, fresh_opt) == 1
    assert torch.equal(fresh.weight, model.weight)


class CountingStore(FaultyStore):
    """The faulty memory store, counting the calls that ask about and write chunks."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.calls: dict[str, int] = {"has": 0, "missing": 0, "put_many": 0}

    def has(self, key: str) -> bool:
        self.calls["has"] += 1
        return super().has(key)

    def missing(self, keys: list[str]) -> list[str]:
        self.calls["missing"] += 1
        return self.inner.missing(keys)

    def put_many(self, items: Sequence[tuple[str, Data]], *, durable: bool = True) -> None:
        self.calls["put_many"] += 1
        super().put_many(items, durable=durable)


def test_small_chunks_are_asked_about_and_written_in_batches() -> None:
    """128 small tensors (16 KiB each) and one of 2 MiB: the small ones' chunks go to the store
    in batches of up to 1 MiB, one call to ask and one to write each (not one per chunk); a
    transient failure retries a batch whole, and the snapshot restores bit-exactly."""
    from ciuic.chain.writer import BATCH_BYTES

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(128)],
                          nn.Linear(1024, 512, bias=False))
    store = CountingStore("batches")  # chunk objects (packs ask nothing: tests/test_packs.py)
    with knobs.override(store_backoff_s=0.01, pack_bytes=0), SnapshotManager(
            "p", job="batches", store=store, save_interval=1, compression="off") as m:
        store.mode = "flaky"
        info = m.save(0, model)
        assert store.failures >= 1 and m.stats.failures == 0
        chunks = list(store.list("chunks/"))
        assert len(chunks) >= 129  # (the RNG states' chunks too)
        assert info.new_bytes >= 128 * 16384 + (2 << 20)
        # the small chunks fill two batches exactly; the others may each need one of their own
        small_batches = 128 * 16384 // BATCH_BYTES
        asked = store.calls["missing"] + store.calls["has"]
        assert small_batches == 2
        assert small_batches + 1 <= asked <= small_batches + 1 + (len(chunks) - 129), store.calls
        # at most one write per batch asked about, and one more per failure (retried whole)
        assert small_batches + 1 <= store.calls["put_many"] - store.failures <= asked, store.calls
        want = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        m.restore(model)
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("same_manager", [False, True])
def test_a_chunk_a_restore_found_damaged_is_written_again_not_reused(
        store_dir: Path, same_manager: bool, chunk_objects: None) -> None:
    """The latest snapshot's chunk was damaged on disk; the restore fell back to the one
    before, and training redid the step with the same bytes: that snapshot reused the damaged
    chunk as already stored, so it was damaged too, and so was every later one. In the manager
    that wrote it (a rollback mid-run) its chunk cache also said the chunk was stored.
    A chunk object, written again in place (a piece in a pack goes into a new pack, and the
    older snapshot keeps its damaged one: tests/test_packs.py)."""
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
        # the damaged step 2 is skipped; the manager that wrote it (a rollback) has its bytes
        # in memory and restores it, then reads the store's copy on its writer thread
        assert m.restore(s=StateHolder()) == (2 if same_manager else 1)
        again = m.save(2, s=StateHolder({"x": values[2].clone()}))
        assert again.new_bytes == n  # written again, over the damaged copy
    with SnapshotManager("p", job="dmg", **kw) as reader:  # from the store
        for snap in (info, again):  # the old step-2 snapshot is whole again too
            h = StateHolder()
            reader.restore(s=h, snapshot=snap.id)
            assert torch.equal(h.state["x"], values[2])
