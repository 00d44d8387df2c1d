"""Mirrored tiers (local disk + S3) and copying chains between stores (push, pull, copy).

The durable tier is moto's standalone S3 server over HTTP (conftest.s3_endpoint)."""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from ciuic import RestoreError, SnapshotManager
from ciuic.chain.read import chunk_refs, object_of, read_body
from ciuic.chain.repo import Repository
from ciuic.chain.verify import verify_job
from ciuic.errors import IntegrityError, StoreAccessError
from ciuic.format import layout
from ciuic.store import MemoryStore, open_store
from ciuic.store.base import Data
from ciuic.store.mirror import MirrorStore
from tests import models
from tests.s3server import client
from tests.test_cli import ciuic

model_opt = partial(models.model_opt, 200, 300, 10, optimizer=torch.optim.Adam)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 200)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def run(store: Path | str, steps: list[int], **kw: object) -> nn.Module:
    model, opt = model_opt()
    with SnapshotManager("proj", job="j", store=store, handle_signals=False, **kw) as m:
        for step in steps:
            train(model, opt, 1)
            m.save(step, model, opt)
    return model


def restored(store: Path | str, **kw: object) -> tuple[int | None, nn.Module]:
    model, opt = model_opt(seed=99)
    with SnapshotManager("proj", job="j", store=store, handle_signals=False, **kw) as m:
        return m.restore(model, opt), model


def same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))


def first_chunk(store: Path | str) -> str:
    repo = Repository.open(store)
    info = repo.catalog.latest("proj", "j")
    assert info is not None
    _, states = read_body(repo, info)
    return object_of(sorted(chunk_refs(states).values(), key=lambda r: r.digest)[0])


def test_losing_the_local_tier_restores_bit_exact_from_s3(tmp_path: Path, s3_url: str) -> None:
    local = tmp_path / "local"
    model = run(local, [1, 2, 3], mirror=s3_url)
    shutil.rmtree(local)  # the machine's disk is gone: objects and catalog
    step, back = restored(tmp_path / "new-machine", mirror=s3_url)
    assert step == 3 and same(back, model)
    assert verify_job(Repository.open(s3_url), "proj", "j", deep=True).ok


def test_a_damaged_object_in_one_tier_is_read_from_the_other(tmp_path: Path,
                                                              s3_url: str) -> None:
    local = tmp_path / "local"
    model = run(local, [1, 2], mirror=s3_url)
    key = first_chunk(local)
    path = local / "objects" / key
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one flipped bit, locally
    step, back = restored(local, mirror=s3_url)
    assert step == 2 and same(back, model)
    assert path.read_bytes() == good  # the local copy was repaired from S3
    # now damage the S3 copy; the (repaired) local one serves the restore
    remote = open_store(s3_url)
    remote.put(key, b"garbage")
    step, back = restored(local, mirror=s3_url)
    assert step == 2 and same(back, model)
    # without a mirror the damage would be fatal: the repair really came from the other tier
    path.write_bytes(b"garbage too")
    try:
        step, _ = restored(local)
    except RestoreError:
        step = None
    assert step != 2


def test_remote_durability_commits_only_once_the_mirror_has_it(tmp_path: Path, s3_url: str,
                                                               s3_endpoint: str) -> None:
    run(tmp_path / "local", [5], mirror=s3_url, durability="remote")
    remote = open_store(s3_url)
    manifests = list(remote.list("jobs/proj/j/manifests/"))
    assert len(manifests) == 1
    # and a dead mirror is refused at once, before training starts
    dead = f"s3://no-such-bucket/x?endpoint={s3_endpoint}"
    with pytest.raises(StoreAccessError, match="does not exist"):
        SnapshotManager("proj", job="k", store=tmp_path / "l2", handle_signals=False,
                        mirror=dead, durability="remote")


class RecordingStore(MemoryStore):
    """A memory store that records the order in which objects arrive."""

    def __init__(self) -> None:
        super().__init__("recording")
        self.order: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def put(self, key: str, data: Data, *, durable: bool = True) -> None:
        self.gate.wait()
        super().put(key, data, durable=durable)
        self.order.append(key)

    def create(self, key: str, data: Data) -> bool:
        self.gate.wait()
        created = super().create(key, data)
        self.order.append(key)
        return created


def test_local_durability_drains_in_write_order_and_never_blocks_the_commit(
        tmp_path: Path) -> None:
    remote = RecordingStore()
    remote.gate.clear()  # the durable tier is stalled: commits must not wait for it
    model, opt = model_opt()
    try:
        m = SnapshotManager("proj", job="j", store=tmp_path / "local", handle_signals=False,
                            mirror=remote)
        info = m.save(1, model, opt)
        assert isinstance(m.repo.store, MirrorStore)
        assert not any("manifests" in k for k in remote.order)
    finally:
        remote.gate.set()
    m.close()  # flushes the mirror
    manifest = layout.manifest_key("proj", "j", info.id)
    assert manifest in remote.order
    position = remote.order.index(manifest)
    before = set(remote.order[:position])
    assert layout.body_key("proj", "j", Repository.open(tmp_path / "local").read_manifest(
        "proj", "j", info.id).body) in before
    assert all(k in before for k in remote.order if k.startswith("chunks/"))


class StalledDeletes(MemoryStore):
    """A memory store whose deletes wait for ``gate``."""

    def __init__(self) -> None:
        super().__init__("stalled-deletes")
        self.gate = threading.Event()

    def delete(self, key: str) -> None:
        self.gate.wait()
        super().delete(key)


def test_a_key_deleted_locally_reads_as_deleted_while_the_durable_tier_catches_up(
        tmp_path: Path) -> None:
    remote = StalledDeletes()
    store = MirrorStore(open_store(tmp_path / "fast"), remote, durability="local")
    try:
        store.put("k/gone", b"old")
        store.put("k/again", b"old")
        assert store.flush() == 0 and remote.has("k/gone")
        store.delete("k/gone")
        store.delete("k/again")
        store.put("k/again", b"new")  # while its remote delete is still stalled
        assert remote.has("k/gone")  # the durable tier has not caught up yet...
        assert not store.has("k/gone")  # ...and yet the mirror answers as the fast tier does
        with pytest.raises(KeyError):
            store.get("k/gone")
        with pytest.raises(KeyError):
            store.get_into("k/gone", [memoryview(bytearray(3))])
        assert store.get("k/again") == b"new"
    finally:
        remote.gate.set()
    assert store.flush() == 0
    assert not remote.has("k/gone")
    assert remote.get("k/again") == b"new"  # the upload followed the delete, not the reverse
    assert not store.has("k/gone")
    store.close()


def test_a_failed_mirror_catches_up_on_the_next_run(tmp_path: Path, s3_endpoint: str) -> None:
    bucket = "ciuic-catch-up"
    url = f"s3://{bucket}/c?endpoint={s3_endpoint}"
    model = run(tmp_path / "local", [1, 2], mirror=url)  # the bucket does not exist yet
    client(s3_endpoint).create_bucket(Bucket=bucket)
    assert list(open_store(url).list("jobs/")) == []
    with SnapshotManager("proj", job="j", store=tmp_path / "local", handle_signals=False,
                         mirror=url) as m:
        assert isinstance(m.repo.store, MirrorStore)
        m.repo.store.flush()
        m.repo.store._pools.shutdown(wait=True)  # the catch-up runs on the mirror's threads
    step, back = restored(tmp_path / "elsewhere", mirror=url)
    assert step == 2 and same(back, model)


# -- push / pull / copy -------------------------------------------------------------------


@pytest.fixture
def chain(tmp_path: Path) -> Iterator[tuple[Path, nn.Module]]:
    store = tmp_path / "a"
    yield store, run(store, [10, 20, 30])


def test_push_then_pull_elsewhere_and_resume(chain: tuple[Path, nn.Module], s3_url: str,
                                             tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    store, model = chain
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store), "push", "proj/j", s3_url)
    assert code == 0, err
    assert "proj/j: 3 new snapshots" in out
    code, out, _ = ciuic(capsys, monkeypatch, "--store", str(store), "push", "j", s3_url)
    assert code == 0 and "0 new snapshots, 0 objects sent" in out  # nothing twice
    other = tmp_path / "other-cluster"
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(other), "pull", "j", s3_url)
    assert code == 0, err
    step, back = restored(other)
    assert step == 30 and same(back, model)
    assert verify_job(Repository.open(other), "proj", "j", deep=True).ok
    code, out, _ = ciuic(capsys, monkeypatch, "--store", str(other), "log", "proj/j")
    assert code == 0
    assert all(re.search(rf"\b{step}\b", out) for step in (10, 20, 30)), out


def test_copy_sends_only_what_is_missing_and_refuses_damage(
        chain: tuple[Path, nn.Module], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = chain
    dst = tmp_path / "b"
    code, out, err = ciuic(capsys, monkeypatch, "copy", str(store), str(dst), "--job", "proj/j",
                           "--create")
    assert code == 0, err
    run(store, [40])  # one more snapshot: an incremental copy
    code, out, err = ciuic(capsys, monkeypatch, "copy", str(store), str(dst))
    assert code == 0 and "1 new snapshot," in out and "already there" in out
    found = re.search(r"(\d+) objects? sent", out)
    assert found, out
    sent = int(found[1])
    assert 0 < sent <= 8  # chunks of one step, a body and a manifest; not the whole chain
    step, _ = restored(dst)
    assert step == 40
    # a damaged source object is never propagated
    key = first_chunk(store)
    (store / "objects" / key).write_bytes(b"rot")
    shutil.rmtree(dst)
    code, out, err = ciuic(capsys, monkeypatch, "copy", str(store), str(dst), "--create")
    assert code != 0
    assert key in err


def test_pull_of_an_unknown_job_lists_what_is_there(chain: tuple[Path, nn.Module],
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = chain
    code, _, err = ciuic(capsys, monkeypatch, "--store", str(tmp_path / "x"), "pull", "nope",
                         str(store))
    assert code != 0 and "proj/j" in err
    code, _, err = ciuic(capsys, monkeypatch, "copy", str(tmp_path / "missing"), str(store))
    assert code != 0 and "no ciuic store" in err


def test_copy_verifies_on_arrival(chain: tuple[Path, nn.Module], tmp_path: Path) -> None:
    from ciuic.chain.transfer import copy_job

    class Lossy(MemoryStore):
        def put(self, key: str, data: Data, *, durable: bool = True) -> None:
            super().put(key, b"x" if key.startswith(("chunks/", "packs/")) else data,
                        durable=durable)

    store, _ = chain
    with pytest.raises(IntegrityError, match="differs from the source"):
        copy_job(Repository.open(store), Lossy(), "proj", "j")


def test_a_copy_does_not_count_pruned_snapshots_as_new(
        chain: tuple[Path, nn.Module], tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    store, _ = chain
    code, out, err = ciuic(capsys, monkeypatch, "--store", str(store), "prune", "proj/j",
                           "--keep-last", "1")
    assert code == 0 and "pruned 2 snapshots" in out, out + err
    code, out, err = ciuic(capsys, monkeypatch, "copy", str(store), str(tmp_path / "b"),
                           "--create")
    text = " ".join(out.split())
    assert code == 0 and "proj/j: 1 new snapshot (and the manifests of 2 pruned ones" in text, (
        out + err)
    code, out, _ = ciuic(capsys, monkeypatch, "--store", str(tmp_path / "b"), "ls")
    assert code == 0 and re.search(r"proj/j\s+1\s+30\b", out), out
