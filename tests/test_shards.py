"""Sharded descriptors and box reads, in one process: the resharding arithmetic of multi-rank
restores (docs/format.md, "Distributed snapshots"), without a process group."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from ciuic import knobs
from ciuic.chain.repo import Repository
from ciuic.chain.writer import ChunkCache, write_leaves
from ciuic.errors import CaptureError, IntegrityError
from ciuic.format.crypto import ObjectCodec
from ciuic.format.shards import Written, assemble, balanced, meta_of, plan, ruled
from ciuic.format.tree import Leaf, holders
from ciuic.restore.boxread import read_box


def boxes(shape: list[int], grid: list[int]) -> list[tuple[list[int], list[int]]]:
    """torch.chunk-style boxes of a grid over ``shape`` (uneven last pieces, like FSDP's)."""
    per_dim = []
    for n, k in zip(shape, grid, strict=True):
        step = -(-n // k)
        per_dim.append([(o, min(step, n - o)) for o in range(0, n, step)])
    return [([o for o, _ in combo], [s for _, s in combo])
            for combo in itertools.product(*per_dim)]


def sharded_leaf(repo: Repository, full: torch.Tensor, grid: list[int]) -> Leaf:
    """Write ``full`` as shards and return the assembled global leaf (descriptor filled)."""
    shape = list(full.shape)
    pieces = []
    for off, size in boxes(shape, grid):
        local = full[tuple(slice(o, o + n) for o, n in zip(off, size, strict=True))].contiguous()
        pieces.append(Leaf("model/w", local, {}, (shape, off)))
    write_leaves(repo, pieces, ChunkCache(), ObjectCodec())
    glob = Leaf("model/w", torch.empty(0), {}, (shape, [0] * len(shape)))
    assemble([glob], [Written("model/w", p.shard[1], p.described)  # type: ignore[arg-type]
                      for p in pieces if p.shard is not None])
    return glob


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_any_box_of_a_sharded_tensor_reads_back_exactly(tmp_path: Path,
                                                        dtype: torch.dtype) -> None:
    repo = Repository.open(tmp_path / "s")
    full = (torch.arange(37 * 23) * 7 % 1009).reshape(37, 23).to(dtype)
    with knobs.override(chunk_bytes=96, inline_max_bytes=16):  # many chunks, some inline
        leaf = sharded_leaf(repo, full, [3, 2])
    assert len(leaf.descriptor["shards"]) == 6
    with ThreadPoolExecutor(4) as pool:
        assert torch.equal(read_box(repo, "model/w", leaf.described, None, None, pool), full)  # type: ignore[arg-type]
        for grid in ([3, 2], [2, 1], [4, 1], [1, 3], [5, 4], [37, 1]):  # same and other layouts
            for off, size in boxes([37, 23], grid):
                got = read_box(repo, "model/w", leaf.described, off, size, pool)  # type: ignore[arg-type]
                want = full[off[0]:off[0] + size[0], off[1]:off[1] + size[1]]
                assert torch.equal(got, want), (grid, off, size)
    repo.close()


def test_a_box_reads_only_the_chunks_that_hold_it(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "s")
    full = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
    with knobs.override(chunk_bytes=256):
        leaf = sharded_leaf(repo, full, [1, 1])  # one piece: 16 chunks of 4 rows
    reads: list[str] = []
    get_into = repo.store.get_into

    def counting(key: str, buffers: list[memoryview]) -> int:
        reads.append(key)
        return get_into(key, buffers)

    repo.store.get_into = counting  # type: ignore[method-assign]
    with ThreadPoolExecutor(2) as pool:
        got = read_box(repo, "model/w", leaf.described, [8, 0], [8, 16], pool)  # type: ignore[arg-type]
    assert torch.equal(got, full[8:16])
    assert len(reads) == 2  # rows 8-15: chunks 2 and 3 of 16
    repo.close()


def test_shards_that_do_not_tile_the_tensor_are_refused(tmp_path: Path) -> None:
    repo = Repository.open(tmp_path / "s")
    full = torch.ones(8, 4)
    pieces = [Leaf("model/w", full[:4].contiguous(), {}, ([8, 4], [0, 0]))]
    write_leaves(repo, pieces, ChunkCache(), ObjectCodec())
    glob = Leaf("model/w", torch.empty(0), {}, ([8, 4], [0, 0]))
    with pytest.raises(IntegrityError, match="cover 16 of 32"):
        assemble([glob], [Written("model/w", [0, 0], pieces[0].described)])  # type: ignore[arg-type]
    repo.close()


def test_plan_writes_each_replica_once_and_spreads_the_bytes() -> None:
    leaves = [Leaf(f"model/w{i}", torch.zeros(100 * (i + 1)), {}) for i in range(8)]
    metas = [meta_of(leaf) for leaf in leaves]
    owners = plan([metas, metas, metas])  # three DDP ranks holding the same tensors
    assert sorted(owners) == sorted(f"model/w{i}" for i in range(8))
    load = [0, 0, 0]
    for key, rank in owners.items():
        load[rank] += next(m["nbytes"] for m in metas if m["path"] == key)
    assert max(load) - min(load) <= 800 * 4  # within the largest tensor
    assert all(load)


def test_replicas_that_may_differ_between_ranks_are_written_by_the_lowest_rank() -> None:
    """BatchNorm statistics under DDP differ between ranks until the next forward: rank 0's
    are the ones DDP keeps, so rank 0 writes them, however the load is spread."""
    big = {**meta_of(Leaf("model/w", torch.zeros(1000), {})), "spread": True}
    stats = [{**meta_of(Leaf(f"model/bn{i}.running_mean", torch.zeros(10), {})),
              "spread": False} for i in range(5)]
    owners = plan([[big, *stats], [big, *stats]])
    assert owners["model/w"] == 0  # the largest piece goes first, to rank 0
    assert all(owners[f"model/bn{i}.running_mean"] == 0 for i in range(5))


@pytest.mark.parametrize("world", [1, 3, 8, 64])
def test_the_plan_of_replicas_is_computed_alone_as_the_exchange_makes_it(world: int) -> None:
    """After a layout change every rank assigns the replicas every rank holds by itself
    (shards.balanced): the same owners plan() gives from world-size equal metas, pinned buffers
    included, ties and equal sizes included."""
    gen = torch.Generator().manual_seed(world)
    sizes = [(f"optimizer/state/l{i}.step" if i % 3 else f"model/l{i}.w",
              int(torch.randint(1, 5, (1,), generator=gen)) * 4, bool(i % 7 == 0))
             for i in range(200)]
    metas = [{"path": k, "dtype": "float32", "shape": [n // 4], "offsets": None,
              "local": [n // 4], "nbytes": n, "spread": not pinned} for k, n, pinned in sizes]
    assert balanced(sizes, world) == plan([metas] * world)


def test_a_box_several_ranks_hold_is_written_by_one_holder_every_holder_names() -> None:
    """The owner of a box HSDP replicates is a holder, the same whoever computes it, and
    spread over the holders across tensors; a pinned one (a buffer) is the lowest holder's."""
    group = (1, 5, 9)
    owners = [ruled(f"model/l{i}.w@{i * 4},0", group, False) for i in range(60)]
    assert set(owners) == set(group)  # each holder writes some
    assert owners == [ruled(f"model/l{i}.w@{i * 4},0", group, False) for i in range(60)]
    assert {ruled(f"model/l{i}.w@0", group, True) for i in range(10)} == {1}
    assert ruled("model/w@0", (7,), False) == 7


def test_holders_of_a_box_are_the_mesh_positions_along_replicated_dimensions() -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = torch.arange(8).reshape(2, 4)  # HSDP: 2 replicas x 4 shards
    assert holders(mesh, [1, 2], [Replicate(), Shard(0)]) == (2, 6)
    assert holders(mesh, [1, 2], [Shard(0), Shard(1)]) == (6,)  # FSDP2 + TP: alone
    strided = _StridedShard(0, split_factor=4)  # FSDP2 over TP's rows: sharded too
    assert holders(mesh, [1, 2], [strided, Shard(0)]) == (6,)
    assert holders(mesh, [1, 2], [strided, Replicate()]) == (4, 5, 6, 7)
    assert holders(mesh, [0, 3], [Replicate(), Replicate()]) == tuple(range(8))
    assert holders(torch.tensor([4, 2, 0]), [1], [Shard(0)]) == (2,)  # global ranks
    assert holders(mesh, [0, 1], [Replicate(), Partial()]) is None  # a partial sum: unknown
    assert holders(mesh, None, [Shard(0), Shard(0)]) is None  # this rank is not in the mesh


def test_plan_refuses_ranks_that_disagree_about_a_tensor() -> None:
    a = [meta_of(Leaf("model/w", torch.zeros(4), {}))]
    b = [meta_of(Leaf("model/w", torch.zeros(5), {}))]
    with pytest.raises(CaptureError, match="model/w: shape"):
        plan([a, b])


def test_an_fsdp2_model_in_one_process_snapshots_and_restores(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A world of one with DTensor parameters takes the multi-rank layout without any peer."""
    import os

    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ciuic import SnapshotManager
    from ciuic.chain.gc import collect
    from ciuic.distributed import save
    from tests.models import linear

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29733")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        def build() -> tuple[nn.Module, torch.optim.Optimizer]:
            model = linear(8, 5, 3)
            fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
            return model, torch.optim.Adam(model.parameters(), lr=0.1)

        model, opt = build()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        tables: list[tuple[str, int] | None] = []
        write_boxes = save._write_boxes

        def counting(*args: Any) -> tuple[str, int] | None:
            tables.append(write_boxes(*args))
            return tables[-1]

        monkeypatch.setattr(save, "_write_boxes", counting)
        with SnapshotManager("p", job="fsdp1", store=tmp_path / "s",
                             handle_signals=False) as m:
            for step in (1, 2, 3):  # the box table: the same bytes, written once
                info = m.save(step, model, opt)
            assert len(tables) == 1 and tables[0] is not None
            with Repository.open(tmp_path / "s") as repo:
                collect(repo)  # a gc may delete what no snapshot names: written again
            info = m.save(4, model, opt)
            assert len(tables) == 2 and tables[1] == tables[0]
        assert info.world_size == 1
        fresh, fresh_opt = build()
        with SnapshotManager("p", job="fsdp1", store=tmp_path / "s",
                             handle_signals=False) as m:
            assert m.restore(fresh, fresh_opt) == 4
        for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(),
                             strict=True):
            assert torch.equal(a.full_tensor(), b.full_tensor()), k
    finally:
        dist.destroy_process_group()


def test_the_plan_is_remade_only_when_a_layout_changes(tmp_path: Path) -> None:
    """The plan exchange carries digests, and the cached owners serve while every rank's
    layout holds; when a rank's layout changed or a rank has no plan of these layouts, every
    rank makes it alone, by rule, after one more digest (a world of one here: what travels is
    the same)."""

    from ciuic.chain.writer import SnapshotWrite
    from ciuic.distributed.collective import Collective
    from ciuic.distributed.messages import Plans
    from ciuic.distributed.plan import capture_dist
    from ciuic.distributed.save import write_dist

    class Recording(Collective):
        def __init__(self) -> None:
            super().__init__(False)
            self.sent: list[Any] = []

        def all_gather(self, value: Any, *, data: bool = False) -> list[Any]:
            self.sent.append(value)
            return super().all_gather(value, data=data)

    repo = Repository.open(tmp_path / "store")
    plans, coll = Plans(), Recording()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    parent = ""

    def snapshot(step: int) -> None:
        nonlocal parent
        w = SnapshotWrite(repo, "p", "j", step, parent, ChunkCache())
        _, parent, _ = write_dist(coll, w, capture_dist(model, None, {}), seq=step,
                                  plans=plans)

    try:
        snapshot(0)
        # digests, then the rule's digest a rank (the ranks agree: no metas exchanged)
        assert plans.made == 1 and plans.exchanged == 0 and len(coll.sent) == 2
        assert isinstance(coll.sent[1], str)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # new values, the same layout
        snapshot(1)
        assert plans.made == 1 and len(coll.sent) == 3  # digests only
        assert coll.sent[2]["metas"] == [] and coll.sent[2]["known"] == plans.joint
        model.append(torch.nn.Linear(2, 2))  # a new tensor: a new layout
        snapshot(2)
        assert plans.made == 2 and plans.exchanged == 0 and len(coll.sent) == 5
        # the new plan covers the new tensor; a world of one writes everything itself
        assert plans.owners == {f"model/{k}": 0 for k in model.state_dict()}
        assert repo.catalog.latest("p", "j") is not None
    finally:
        repo.close()


def test_a_box_on_a_sub_mesh_has_no_holders_the_rank_can_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A DTensor on a part of the job's ranks (DDP over TP groups: the same box on ranks 0 and
    2, each in its own sub-mesh) has holders this rank cannot name: None, so the plan is made
    from every rank's metas, not by rule, and nothing is predicted."""
    from torch.distributed.tensor import Replicate, Shard

    from ciuic.format import tree

    class Mesh:
        def __init__(self, ranks: list[int], coordinate: list[int]) -> None:
            self.mesh, self._coordinate = torch.tensor(ranks), coordinate

        def get_coordinate(self) -> list[int]:
            return self._coordinate

    class Fake:
        def __init__(self, mesh: Mesh) -> None:
            self.device_mesh, self.placements, self.shape = mesh, (Shard(0),), (8, 4)

    monkeypatch.setattr(tree, "_world_size", lambda: 4)
    assert tree.dtensor_class(Fake(Mesh([0, 1], [0]))) is not None
    assert tree.dtensor_class(Fake(Mesh([0, 1], [0])))[1] is None  # type: ignore[index]
    whole = Fake(Mesh([0, 1, 2, 3], [2]))
    assert tree.dtensor_class(whole)[1] == (2,)  # type: ignore[index]
    whole.placements = (Replicate(),)
    assert tree.dtensor_class(whole)[1] == (0, 1, 2, 3)  # type: ignore[index]
