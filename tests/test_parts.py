"""A multi-rank snapshot's body in parts (docs/format.md, body format 3): every rank writes its
part, the coordinator an index; gc, verify and the copy between stores treat the parts as the
body's; a damaged part is named. One process with DTensor parameters (a world of one) writes
the same split body a job of many ranks does; tests/test_dist.py covers 4 ranks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ciuic import SnapshotManager, knobs
from ciuic.chain.gc import collect
from ciuic.chain.read import Parts, body_keys, read_body
from ciuic.chain.repo import Repository
from ciuic.chain.retention import prune
from ciuic.chain.transfer import copy_job
from ciuic.chain.verify import verify_job
from ciuic.distributed.load import _Near
from ciuic.errors import CorruptObject
from ciuic.format import layout
from ciuic.format.boxes import BoxTable
from ciuic.format.parts import BodyPart, merge
from ciuic.format.tree import walk_leaves
from tests.models import linear


@pytest.fixture
def world_of_one(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"file://{tmp_path / 'pg'}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded() -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = linear(8, 5, 3)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_the_index_lists_no_shard_and_the_parts_merge_into_the_whole_body(
        tmp_path: Path, world_of_one: None) -> None:
    model, opt = sharded()
    store = tmp_path / "s"
    with SnapshotManager("p", job="j", store=store, handle_signals=False) as m:
        for step in range(3):
            train(model, opt)
            info = m.save(step, model, opt)
    with Repository.open(store) as repo:
        manifest, index = read_body(repo, info, parts=False)
        descs = [d for _, _, d in walk_leaves({"model": index["model"],
                                               "optimizer": index["optimizer"]})]
        assert descs and all(d.get("split") is True and "shards" not in d for d in descs
                             if d["shape"] != [])  # Adam's step counters are replicated
        assert "ranks" not in index and len(index["dist"]["parts"]) == 1
        _, whole = read_body(repo, info)
        assert len(whole["ranks"]) == 1 and "rng" in whole["ranks"][0]
        for _, _, d in walk_leaves({"model": whole["model"]}):
            assert "split" not in d and len(d["shards"]) == 1
        keys = body_keys(manifest, index)  # the index, the part, the box table
        assert len(keys) == 3 and all(repo.store.has(k) for k in keys)
        assert keys[2] == layout.body_key("p", "j", index["dist"]["boxes"][0])
    fresh, fresh_opt = sharded()
    with SnapshotManager("p", job="j", store=store, handle_signals=False) as m:
        assert m.restore(fresh, fresh_opt) == 2
        assert m.stats.restore_parts == (1, 1)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), k


def test_gc_verify_and_copies_keep_a_split_body_whole(tmp_path: Path,
                                                       world_of_one: None) -> None:
    model, opt = sharded()
    store = tmp_path / "s"
    with SnapshotManager("p", job="j", store=store, handle_signals=False) as m:
        for step in range(3):
            train(model, opt)
            m.save(step, model, opt)
    with Repository.open(store) as repo:
        info = repo.resolve("p/j@latest")
        manifest, index = read_body(repo, info, parts=False)
        part_key = body_keys(manifest, index)[1]
        assert len(prune(repo, "p", "j", 1, None)) == 2  # their indexes go
        result = collect(repo)
        # the two pruned snapshots' parts went; the latest's index and part stayed
        assert result.deleted_bodies == 2 and not result.damaged
        assert repo.store.has(part_key)
        # the index, the part, and the box table every snapshot of this layout shares
        table_key = body_keys(manifest, index)[2]
        assert sum(1 for k in repo.store.list(layout.bodies_prefix("p", "j"))) == 3
        checked = verify_job(repo, "p", "j", deep=True)
        assert checked.problems == [] and checked.snapshots == 1
        # a copy to another store carries the part with the index
        with Repository.open(tmp_path / "copy") as copied:
            stats = copy_job(repo, copied.store, "p", "j")
            assert (stats.snapshots, stats.pruned) == (1, 2)  # the pruned two: manifests only
            assert copied.store.has(part_key) and copied.store.has(table_key)
        blob = repo.store.get(part_key)
        repo.store.delete(part_key)
        problems = verify_job(repo, "p", "j").problems
        assert [p.key for p in problems] == [part_key]
        assert "missing" in problems[0].reason and "rank 0's part" in problems[0].reason
        # gc deletes nothing while a body it must read is incomplete
        assert collect(repo).damaged
        repo.store.put(part_key, blob[:-1] + bytes([blob[-1] ^ 1]))
        with pytest.raises(CorruptObject, match="does not match its name"):
            read_body(repo, info)
    with Repository.open(tmp_path / "copy") as copied:
        copied.sync_job("p", "j")
        checked = verify_job(copied, "p", "j", deep=True)
        assert checked.problems == [] and checked.snapshots == 1 and checked.pruned == 2
        fresh, fresh_opt = sharded()
        with SnapshotManager("p", job="j", store=tmp_path / "copy",
                             handle_signals=False) as m:
            assert m.restore(fresh, fresh_opt) == 2


def test_a_part_is_checked_against_its_name_and_its_index() -> None:
    part = BodyPart(0, {"model/w": [{"offsets": [0], "shape": [2], "nbytes": 8,
                                     "inline": "AAAAAAAAAAA="}]}, {"rng": {}}, ())
    data = part.encode()
    from ciuic.format.digest import digest

    name = digest(data)
    assert BodyPart.decode(data, "k", name) == part
    with pytest.raises(CorruptObject, match="does not match its name"):
        BodyPart.decode(data + b" ", "k", name)
    bad = data.replace(b'"rank":0', b'"rank":"0"')
    with pytest.raises(CorruptObject, match="'rank' is not an integer"):
        BodyPart.decode(bad, "k", digest(bad))
    # a part holding shards of a tensor the index does not list as split
    index = {"model": {"v": {"$tensor": {"dtype": "float32", "shape": [2], "nbytes": 8,
                                         "split": True}}},
             "dist": {"world_size": 1, "parts": [[name, len(data)]]}}
    with pytest.raises(CorruptObject, match="model/w, which the body does not list"):
        merge(index, [part], "k")


def test_parts_of_a_body_in_one_piece_are_none(tmp_path: Path) -> None:
    from ciuic import StateHolder

    with SnapshotManager("p", job="flat", store=tmp_path / "s", handle_signals=False) as m:
        info = m.save(1, StateHolder({"w": torch.ones(3)}))
    with Repository.open(tmp_path / "s") as repo:
        manifest, states = read_body(repo, info, parts=False)
        assert Parts.of(repo, manifest, states) is None
        assert body_keys(manifest, states) == [layout.body_key("p", "flat", manifest.body)]


def test_a_sealed_store_seals_the_parts_too(tmp_path: Path, world_of_one: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from ciuic.format.crypto import generate_key_text

    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", generate_key_text())
    monkeypatch.delenv("CIUIC_ENCRYPTION_KEY_FILE", raising=False)
    model, opt = sharded()
    train(model, opt)
    store = tmp_path / "s"
    with SnapshotManager("p", job="j", store=store, handle_signals=False,
                         encryption=True) as m:
        info = m.save(1, model, opt)
    with Repository.open(store) as repo:
        manifest, index = read_body(repo, info, parts=False)
        part_key = body_keys(manifest, index)[1]
        raw = repo.store.get(part_key)
        assert b"model/" not in raw and not raw.startswith(b"{")  # no plaintext path names
    fresh, fresh_opt = sharded()
    with SnapshotManager("p", job="j", store=store, handle_signals=False,
                         encryption=True) as m:
        assert m.restore(fresh, fresh_opt) == 1
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), k


def test_a_format_2_body_of_an_earlier_version_still_restores(tmp_path: Path,
                                                              world_of_one: None) -> None:
    """Snapshots taken before bodies were split (one body: every shard, ``ranks``) restore
    as before: the same snapshot rewritten as format 2, under another job."""
    from ciuic.format import manifest as mf
    from ciuic.format.digest import digest

    model, opt = sharded()
    train(model, opt)
    store = tmp_path / "s"
    with knobs.override(pack_bytes=0), SnapshotManager(  # written as before packs (format 2)
            "p", job="j", store=store, handle_signals=False) as m:
        info = m.save(7, model, opt)
    with Repository.open(store) as repo:
        new, states = read_body(repo, info)
        del states["dist"]["parts"]
        body = mf.encode_body(states, distributed=True)
        assert b'"format":2' in body and b'"shards"' in body and b'"split"' not in body
        name = digest(body)
        repo.store.put(layout.body_key("p", "old", name), body)
        old = mf.Manifest(project="p", job="old", step=7, parent="", created=new.created,
                          body=name, body_bytes=len(body), total_bytes=new.total_bytes,
                          new_bytes=new.new_bytes, tensors=new.tensors, world_size=1,
                          metrics={})
        data = old.encode()
        assert repo.store.create(layout.manifest_key("p", "old", digest(data)), data)
    fresh, fresh_opt = sharded()
    with SnapshotManager("p", job="old", store=store, handle_signals=False) as m:
        assert m.restore(fresh, fresh_opt) == 7
        assert m.stats.restore_parts == (0, 0)  # one body: no parts
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), k


def test_a_box_table_names_the_parts_that_hold_a_box_once_per_class() -> None:
    """format/boxes.py: 4 ranks, a class sharded 4 ways along rows and one HSDP-like class
    (2 shards, each held by 2 replicas); a path in no class asks for every part."""
    rows = [(r, [("a", [r * 4, 0], [4, 8]), ("b", [(r // 2) * 8, 0], [8, 8])])
            for r in range(4)]
    table = BoxTable.build({"a": ["m/w1", "m/w2"], "b": ["m/v"]}, rows)
    assert table.ranks_for({"m/w1": ([0, 0], [8, 8])}) == {0, 1}  # rows 0-7: ranks 0, 1
    assert table.ranks_for({"m/w2": ([6, 0], [4, 8]), "m/v": ([0, 0], [4, 8])}) == {1, 2, 0}
    assert table.ranks_for({"m/v": ([12, 0], [4, 8])}) == {2, 3}  # either replica's part
    assert table.ranks_for({"m/other": ([0, 0], [1, 1])}) is None
    from ciuic.format.digest import digest

    data = table.encode()
    assert BoxTable.decode(data, "k", digest(data)) == table
    with pytest.raises(CorruptObject, match="does not match its name"):
        BoxTable.decode(data + b" ", "k", digest(data))
    bad = data.replace(b'"format":1', b'"format":9')
    with pytest.raises(CorruptObject, match="format 9 is not 1: upgrade ciuic"):
        BoxTable.decode(bad, "k", digest(bad))
    bad = data.replace(b'"paths":["m/v"]', b'"paths":[1]')
    with pytest.raises(CorruptObject, match="malformed box table"):
        BoxTable.decode(bad, "k", digest(bad))
    assert BoxTable.build({"a": ["m/w1"]}, [(0, [("z", [0], [1])])]).classes == ()


def test_on_another_layout_a_damaged_box_table_reads_every_part(
        tmp_path: Path, world_of_one: None, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = sharded()
    store = tmp_path / "s"
    with SnapshotManager("p", job="j", store=store, handle_signals=False) as m:
        train(model, opt)
        info = m.save(1, model, opt)
    with Repository.open(store) as repo:
        manifest, index = read_body(repo, info, parts=False)
        split = {p: d for p, _, d in walk_leaves(
            {"model": index["model"]}, "") if d.get("split") is True}
        boxes = {p: ([0] * len(d["shape"]), list(d["shape"])) for p, d in split.items()}
        parts = Parts.of(repo, manifest, index)
        assert parts is not None
        table = parts.boxes()
        assert table is not None and table.ranks_for(boxes) == {0}
        # a rank of a world of two (another layout) reads the part the table names
        found = _Near(parts, 0, 1, 2).shards(split, boxes)
        assert all(len(d["shards"]) == 1 for d in found.values())
        key = body_keys(manifest, index)[2]
        repo.store.put(key, repo.store.get(key)[:-2] + b"]}")
        parts = Parts.of(repo, manifest, index)
        assert parts is not None
        with caplog.at_level("WARNING", logger="ciuic"):
            found = _Near(parts, 0, 1, 2).shards(split, boxes)
        assert all(len(d["shards"]) == 1 for d in found.values())
        assert "reading every rank's part instead" in caplog.text and key in caplog.text
        assert [p.key for p in verify_job(repo, "p", "j").problems] == [key]
