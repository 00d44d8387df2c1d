"""Packs (issue #45, chain/packs.py, format.md "Packs"): a snapshot's pieces smaller than a chunk
go into a few pack objects, each piece still named by its digest and checked on every read; the
chunk cache, incremental snapshots, gc, verify, copies, encryption and every store understand
them; snapshots without packs (older ones, or ``pack_bytes=0``) still read and write as before.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager, StateHolder, knobs
from ciuic.chain.gc import collect
from ciuic.chain.packreads import PackRuns
from ciuic.chain.read import body_states, chunk_refs
from ciuic.chain.repo import Repository
from ciuic.chain.transfer import copy_job
from ciuic.chain.verify import verify_job
from ciuic.errors import CorruptObject, IntegrityError, RestoreError
from ciuic.format import layout
from ciuic.format.crypto import generate_key_text
from ciuic.format.descriptor import ChunkRef, TensorDescriptor, holds_packed
from ciuic.store import LocalStore
from tests.serverutil import new_key, serve

SMALL = 100  # tensors of 10,000 float32s: 40 KB each, 4 MB in all
PACK_BYTES = 4 * 1024 * 1024


@pytest.fixture(autouse=True)
def _packs() -> Iterator[None]:
    """Packs of 4 MiB (the knob's default), whatever the default becomes."""
    with knobs.override(pack_bytes=PACK_BYTES):
        yield


def small_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i:03d}": torch.randn(10_000, generator=g) for i in range(SMALL)}


def keys(store: Path | str, prefix: str) -> list[str]:
    return list(LocalStore(Path(store) / "objects").list(prefix))


def restored(m: SnapshotManager, like: dict[str, torch.Tensor],
             snapshot: str | None = None) -> dict[str, torch.Tensor]:
    holder = StateHolder({})
    m.restore(state=holder, snapshot=snapshot)
    assert set(holder.state) == set(like)
    return {k: v.clone() for k, v in holder.state.items()}


def body_of(repo: Repository, sid: str, project: str = "p", job: str = "k") -> bytes:
    m = repo.read_manifest(project, job, sid)
    return repo.store.get(layout.body_key(project, job, m.body))


def refs_of(store: Path, sid: str) -> dict[str, ChunkRef]:
    repo = Repository.open(store)
    try:
        return chunk_refs(body_states(repo, repo.read_manifest("p", "k", sid)))
    finally:
        repo.close()


def test_small_pieces_go_into_a_few_packs_and_restore_bit_exact(store_dir: Path) -> None:
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        info = m.save(1, state=StateHolder(live))
        got = restored(m, live)
    assert all(torch.equal(got[k], live[k]) for k in live)
    assert keys(store_dir, "chunks/") == []  # no object of its own
    packs = keys(store_dir, "packs/")
    assert len(packs) == 1  # 4 MB of pieces in one pack of about 4 MiB
    refs = refs_of(store_dir, info.id)
    # (the run's own state, its RNGs, in the same pack)
    assert len(refs) >= SMALL and {r.pack for r in refs.values()} == {packs[0].rsplit("/")[-1]}
    offsets = sorted((r.offset, r.stored) for r in refs.values())
    assert offsets[0][0] == 0 and all(  # back to back
        a + n == b for (a, n), (b, _) in itertools.pairwise(offsets))
    repo = Repository.open(store_dir)
    try:
        body = json.loads(body_of(repo, info.id))
        assert body["format"] == 4 and holds_packed(body["states"])
    finally:
        repo.close()


def test_with_packs_off_every_piece_is_its_own_object_in_the_old_format(store_dir: Path) -> None:
    live = small_state()
    with knobs.override(pack_bytes=0), SnapshotManager("p", job="k", store=store_dir,
                                                       compression="off") as m:  # older
        info = m.save(1, state=StateHolder(live))
    plain = keys(store_dir, "chunks/")  # (and the run's RNG states, each its own too)
    assert len(plain) >= SMALL and keys(store_dir, "packs/") == []
    repo = Repository.open(store_dir)
    try:
        assert json.loads(body_of(repo, info.id))["format"] == 1
    finally:
        repo.close()
    # a later ciuic with packs reads it, and reuses its chunk objects for unchanged bytes
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        assert torch.equal(restored(m, live)["t007"], live["t007"])
        live["t003"].add_(1.0)
        second = m.save(2, state=StateHolder(live))
    assert second.new_bytes == 40_000
    refs = refs_of(store_dir, second.id)
    assert sum(r.pack is not None for r in refs.values()) == 1  # the changed one, packed
    assert keys(store_dir, "chunks/") == plain  # nothing else written again


def test_an_incremental_snapshot_writes_only_changed_pieces_into_a_new_pack(
        store_dir: Path) -> None:
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        first = m.save(1, state=StateHolder(live))
        for k in ("t010", "t020", "t030"):
            live[k].mul_(1.5)
        second = m.save(2, state=StateHolder(live))
        assert second.new_bytes == 3 * 40_000
        assert len(keys(store_dir, "packs/")) == 2
        a, b = refs_of(store_dir, first.id), refs_of(store_dir, second.id)
        moved = {k for k in b if b[k].pack != next(iter(a.values())).pack}
        assert len(moved) == 3  # the three changed pieces, in the new pack
        got = restored(m, live)
        old = restored(m, small_state(), snapshot=first.id)
    assert all(torch.equal(got[k], live[k]) for k in live)
    assert all(torch.equal(old[k], small_state()[k]) for k in live)


def test_a_mostly_dead_pack_is_not_kept_alive_by_a_few_unchanged_pieces(
        store_dir: Path) -> None:
    """The carry rule: the second snapshot changes 90 of 100 pieces; the 10 unchanged ones
    would keep the first pack (10 % of it referenced) alive for as long as any snapshot holds
    them, so they are written again into a pack of carried pieces; once the first snapshot is
    pruned, gc deletes the first pack, and the third snapshot (nothing changed) references the
    carried pack as it is."""
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off",
                         keep_last=1) as m:
        first = m.save(1, state=StateHolder(live))
        refs1 = refs_of(store_dir, first.id)  # (read now: the first snapshot gets pruned)
        (pack1,) = {r.pack for r in refs1.values()}
        for i in range(10, SMALL):
            live[f"t{i:03d}"].mul_(1.5)
        second = m.save(2, state=StateHolder(live))
        refs2 = refs_of(store_dir, second.id)
        assert pack1 not in {r.pack for r in refs2.values()}
        assert second.new_bytes >= SMALL * 40_000  # the 90 changed, and the 10 carried
        carried = {refs2[d].pack for d in refs2 if d in refs1}
        new = {refs2[d].pack for d in refs2 if d not in refs1}
        assert len(carried) == 1 and not carried & new  # the unchanged together, apart
        third = m.save(3, state=StateHolder(live))
        assert third.new_bytes == 0
        assert {r.pack for r in refs_of(store_dir, third.id).values()} == {
            r.pack for r in refs2.values()}
        got = restored(m, live)
    assert all(torch.equal(got[k], live[k]) for k in live)
    repo = Repository.open(store_dir)
    try:
        collect(repo)
        assert not repo.store.has(layout.pack_key(pack1))
        assert len(list(repo.store.list("packs/"))) == 2
    finally:
        repo.close()


def test_gc_keeps_a_pack_while_one_piece_of_it_is_referenced(store_dir: Path) -> None:
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off", keep_last=1) as m:
        first = m.save(1, state=StateHolder(live))
        (pack1,) = {r.pack for r in refs_of(store_dir, first.id).values()}
        live["t000"].add_(1.0)  # 99 of 100 unchanged: the first pack stays referenced
        second = m.save(2, state=StateHolder(live))
    assert sum(r.pack == pack1 for r in refs_of(store_dir, second.id).values()) >= SMALL - 1
    repo = Repository.open(store_dir)
    try:
        orphan = layout.pack_key("0" * 64)
        repo.store.put(orphan, b"a pack no snapshot references")
        result = collect(repo)
        assert repo.store.has(layout.pack_key(pack1)) and not repo.store.has(orphan)
        assert result.deleted_chunks >= 1
    finally:
        repo.close()


def test_a_damaged_manifest_keeps_the_packs_its_body_names(store_dir: Path) -> None:
    """gc cannot tell which snapshot a damaged manifest was: it keeps every body no readable
    manifest names, and the packs those bodies' references name."""
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        m.save(1, state=StateHolder(live))
        for t in live.values():
            t.mul_(2.0)
        second = m.save(2, state=StateHolder(live))
    packs2 = {r.pack for r in refs_of(store_dir, second.id).values()}
    (store_dir / "objects" / layout.manifest_key("p", "k", second.id)).write_bytes(b"bad\n")
    repo = Repository.open(store_dir)
    try:
        result = collect(repo)
        assert result.damaged == [layout.manifest_key("p", "k", second.id)]
        assert all(repo.store.has(layout.pack_key(p)) for p in packs2 if p is not None)
        assert result.kept_for_damage >= 1
    finally:
        repo.close()


def _flip(store: Path, pack: str, at: int) -> None:
    path = store / "objects" / layout.pack_key(pack)
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_damaged_piece_is_found_named_and_refused(store_dir: Path) -> None:
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        info = m.save(1, state=StateHolder(live))
    refs = refs_of(store_dir, info.id)
    bad = refs["placeholder"] if "placeholder" in refs else sorted(
        refs.values(), key=lambda r: r.offset)[7]
    assert bad.pack is not None
    _flip(store_dir, bad.pack, bad.offset + 100)
    repo = Repository.open(store_dir)
    try:
        report = verify_job(repo, "p", "k", deep=True)
        assert [p.key for p in report.problems] == [layout.chunk_key(bad.digest)]
        assert f"at byte {bad.offset} of {layout.pack_key(bad.pack)}" in report.problems[
            0].reason
        assert not verify_job(repo, "p", "k").problems  # present: only a deep check reads it
    finally:
        repo.close()
    with SnapshotManager("p", job="k2", store=store_dir) as m2, pytest.raises(
            RestoreError, match=f"{bad.digest[:16]}.*at byte {bad.offset} of packs/"):
        m2.restore(state=StateHolder({}), snapshot=info.id)
    # a missing pack: each piece it held is reported missing
    (store_dir / "objects" / layout.pack_key(bad.pack)).unlink()
    repo = Repository.open(store_dir)
    try:
        report = verify_job(repo, "p", "k")
        assert len(report.problems) >= SMALL  # (and the run's RNG states, packed too)
        assert all(p.reason == "missing" for p in report.problems)
    finally:
        repo.close()


def test_a_damaged_piece_in_the_latest_falls_back_and_is_written_again(store_dir: Path) -> None:
    """The latest snapshot's changed piece is damaged in its pack: a restarted job falls back
    to the snapshot before, and the next snapshot holding those bytes writes the piece again
    into a new pack rather than referencing the damaged one."""
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        first = m.save(1, state=StateHolder(live))
        before = {k: v.clone() for k, v in live.items()}
        live["t050"].mul_(3.0)
        second = m.save(2, state=StateHolder(live))
    refs1, refs2 = refs_of(store_dir, first.id), refs_of(store_dir, second.id)
    (d,) = [d for d in refs2 if d not in refs1 and refs2[d].nbytes == 40_000]
    bad = refs2[d]
    assert bad.pack is not None
    _flip(store_dir, bad.pack, bad.offset + 64)
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        got = restored(m, live)
        assert all(torch.equal(got[k], before[k]) for k in live)  # the first one's
        third = m.save(3, state=StateHolder(live))  # the second's bytes again
        again = refs_of(store_dir, third.id)[d]
        assert again.pack != bad.pack
        assert torch.equal(restored(m, live)["t050"], live["t050"])


def test_compressed_pieces_in_a_pack_restore_bit_exact(store_dir: Path) -> None:
    g = torch.Generator().manual_seed(1)  # 80,000 bf16 each: over the codec's smallest piece
    live = {f"t{i:03d}": torch.randn(80_000, generator=g).to(torch.bfloat16)
            for i in range(20)}
    with SnapshotManager("p", job="k", store=store_dir, compression="on") as m:
        info = m.save(1, state=StateHolder(live))
        got = restored(m, live)
    assert all(torch.equal(got[k], live[k]) for k in live)
    refs = refs_of(store_dir, info.id)
    big = [r for r in refs.values() if r.nbytes == 160_000]
    assert len(big) == 20 and all(r.pack is not None and r.stored < 0.8 * r.nbytes
                                  for r in big)  # compressed, in the pack


def test_sealed_pieces_in_a_pack_open_only_at_their_own_digest(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", generate_key_text())
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, encryption=True,
                         compression="off") as m:
        info = m.save(1, state=StateHolder(live))
        got = restored(m, live)
    assert all(torch.equal(got[k], live[k]) for k in live)
    (pack,) = keys(store_dir, "packs/")
    raw = (store_dir / "objects" / pack).read_bytes()
    assert live["t042"].numpy().tobytes()[:64] not in raw  # sealed
    refs = sorted(refs_of(store_dir, info.id).values(), key=lambda r: r.offset)
    a, b = refs[0], refs[1]
    assert a.stored == b.stored  # swap two sealed pieces of the same size in the pack
    swapped = bytearray(raw)
    swapped[a.offset:a.offset + a.stored] = raw[b.offset:b.offset + b.stored]
    swapped[b.offset:b.offset + b.stored] = raw[a.offset:a.offset + a.stored]
    (store_dir / "objects" / pack).write_bytes(bytes(swapped))
    repo = Repository.open(store_dir)
    try:
        problems = verify_job(repo, "p", "k", deep=True).problems
        assert {p.key for p in problems} == {layout.chunk_key(a.digest),
                                             layout.chunk_key(b.digest)}
    finally:
        repo.close()


@pytest.fixture(params=["local", "s3", "server"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Where a job's chain is copied: another local store, S3 (moto), a ciuic server."""
    if request.param == "local":
        yield str(tmp_path / "other")
    elif request.param == "s3":
        yield request.getfixturevalue("s3_url")
    else:
        store = tmp_path / "served"
        key = new_key(store, "p", "writer")
        with serve(store, tmp_path / "server.log") as url:
            yield f"{url}/v1/projects/p?key={key}"


def test_packs_are_copied_and_read_on_every_store(store_dir: Path, remote: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain with packs pushed to each kind of store, then restored there: every piece read
    with a ranged read of its pack; a snapshot written there directly too."""
    if "?key=" in remote:
        url, key = remote.split("?key=")
        monkeypatch.setenv("CIUIC_API_KEY", key)
        remote = url
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        info = m.save(1, state=StateHolder(live))
    src, dst = Repository.open(store_dir), Repository.open(remote)
    try:
        stats = copy_job(src, dst.store, "p", "k")
        assert stats.snapshots == 1
        assert len(list(dst.store.list("packs/"))) == 1 and not list(dst.store.list("chunks/"))
    finally:
        src.close()
        dst.close()
    with SnapshotManager("p", job="k", store=remote) as there:
        got = restored(there, live, snapshot=info.id)
        live["t001"].add_(2.0)
        again = there.save(2, state=StateHolder(live))
        assert again.new_bytes == 40_000
        after = restored(there, live)
    assert all(torch.equal(got[k], small_state()[k]) for k in live)
    assert all(torch.equal(after[k], live[k]) for k in live)


def test_the_reference_of_a_piece_in_a_pack_has_fixed_bytes() -> None:
    """The format's golden bytes, extended: a descriptor with a plain and a packed reference."""
    d = TensorDescriptor(dtype="float32", shape=(3, 4), nbytes=48, chunks=(
        ChunkRef("a" * 64, 16), ChunkRef("b" * 64, 32, "c" * 64, 4096, 48)))
    from ciuic.format import canonical

    assert canonical.dumps(d.to_json()) == (
        b'{"chunks":[["' + b"a" * 64 + b'",16],["' + b"b" * 64 + b'",32,"' + b"c" * 64
        + b'",4096,48]],"dtype":"float32","nbytes":48,"shape":[3,4]}')
    assert TensorDescriptor.from_json(json.loads(canonical.dumps(d.to_json()))) == d
    for bad in ([["a" * 64, 16, "c" * 64, -1, 48]], [["a" * 64, 16, "c" * 64, 0]],
                [["a" * 64, 16, 7, 0, 48]]):
        with pytest.raises(IntegrityError, match="malformed tensor descriptor"):
            TensorDescriptor.from_json({"dtype": "float32", "shape": [4], "nbytes": 16,
                                        "chunks": bad})


def test_a_restore_reads_each_pack_in_one_request_not_one_per_piece(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold restore of 100 pieces in one pack makes one ranged read of it (its run), then
    checks each piece from those bytes (chain/packreads.py)."""
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        info = m.save(1, state=StateHolder(live))
    ranged: list[tuple[str, int, int]] = []
    get_into = LocalStore.get_into

    def counted(self: LocalStore, key: str, buffers: list[memoryview], offset: int = 0) -> int:
        if key.startswith(layout.PACKS):
            ranged.append((key, offset, sum(b.nbytes for b in buffers)))
        return get_into(self, key, buffers, offset)

    monkeypatch.setattr(LocalStore, "get_into", counted)
    with SnapshotManager("p", job="k2", store=store_dir) as m2:
        holder = StateHolder({})
        m2.restore(state=holder, snapshot=info.id)
        got = holder.state
    assert all(torch.equal(got[k], live[k]) for k in live)
    (pack,) = keys(store_dir, "packs/")
    size = (store_dir / "objects" / pack).stat().st_size
    assert ranged == [(pack, 0, size)]  # the whole pack: every piece in it is read


def test_runs_merge_neighbouring_pieces_up_to_a_gap_and_a_size(repo: Repository) -> None:
    a, b = "a" * 64, "b" * 64

    def ref(pack: str, offset: int, stored: int) -> ChunkRef:
        return ChunkRef(f"{offset:064x}", stored - 32, pack, offset, stored)

    refs = [ref(a, 0, 100), ref(a, 100, 100), ref(a, 205, 50),  # 5 apart: one run, but 255 > 250
            ref(a, 400, 50), ref(a, 400, 50),  # 145 past the last: a run of its own (read twice)
            ref(b, 1000, 10), ChunkRef("c" * 64, 10)]  # another pack; a chunk object: none
    runs = PackRuns(repo, refs, gap=10, most=250)
    assert runs.runs == 4  # [0, 200) [205, 255) [400, 450) of a, [1000, 1010) of b


def test_runs_are_fetched_ahead_of_their_readers_within_the_bound(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restore fetches runs ahead of the pieces being read, several at once, as long as the
    runs fetched and not yet taken stay within ``read_ahead_bytes`` (0: each run by its first
    reader); every run is still read once, and every piece checked."""
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        info = m.save(1, state=StateHolder(live))
    refs = sorted((r for r in refs_of(store_dir, info.id).values() if r.pack is not None),
                  key=lambda r: r.offset)
    tensors = {t.numpy().tobytes() for t in live.values()}
    run_bytes = 10 * refs[0].stored  # about ten runs of ten pieces
    lock = threading.Lock()
    flight = {"now": 0, "most": 0}
    get_into = LocalStore.get_into

    def slow(self: LocalStore, key: str, buffers: list[memoryview], offset: int = 0) -> int:
        if not key.startswith(layout.PACKS):
            return get_into(self, key, buffers, offset)
        with lock:
            flight["now"] += 1
            flight["most"] = max(flight["most"], flight["now"])
        try:
            time.sleep(0.05)  # a round trip: reads that overlap are seen to
            return get_into(self, key, buffers, offset)
        finally:
            with lock:
                flight["now"] -= 1

    monkeypatch.setattr(LocalStore, "get_into", slow)
    repo = Repository.open(store_dir)
    try:
        for ahead, most in ((20 * run_bytes, range(3, 9)), (1, range(1, 2)), (0, range(1, 2))):
            flight["most"] = 0
            with PackRuns(repo, refs, most=run_bytes, ahead=ahead) as runs:
                assert runs.runs >= 8
                for r in refs:  # one reader, in the registered order
                    got = bytearray(r.nbytes)
                    runs.read(r, memoryview(got))
                    assert r.nbytes != 40_000 or bytes(got) in tensors  # (rng: others)
            assert flight["most"] in most, (ahead, flight["most"])
            assert runs.requests == runs.runs  # each run read once
        runs = PackRuns(repo, refs, most=run_bytes, ahead=20 * run_bytes)
        runs.start()
        runs.close()  # fetches not started are dropped: their readers fetch them
        for r in refs:
            got = bytearray(r.nbytes)
            runs.read(r, memoryview(got))
            assert r.nbytes != 40_000 or bytes(got) in tensors
        assert runs.requests == runs.runs
    finally:
        repo.close()


def test_a_truncated_pack_serves_the_pieces_it_holds_and_names_the_rest(
        store_dir: Path) -> None:
    live = small_state()
    with SnapshotManager("p", job="k", store=store_dir, compression="off") as m:
        info = m.save(1, state=StateHolder(live))
    refs = sorted((r for r in refs_of(store_dir, info.id).values() if r.pack is not None),
                  key=lambda r: r.offset)
    (pack,) = {r.pack for r in refs}
    assert pack is not None
    cut = refs[len(refs) // 2]
    path = store_dir / "objects" / layout.pack_key(pack)
    path.write_bytes(path.read_bytes()[:cut.offset + 10])  # into the middle piece
    repo = Repository.open(store_dir)
    try:
        runs = PackRuns(repo, refs)
        assert runs.runs == 1
        for r in refs[:len(refs) // 2]:  # whole in what is left: served from the one read
            runs.read(r, memoryview(bytearray(r.nbytes)))
        assert runs.requests == 1
        with pytest.raises(CorruptObject, match=f"holds {cut.offset + 10} bytes, not the "
                                                f"{cut.offset + cut.stored} .*truncated"):
            runs.read(cut, memoryview(bytearray(cut.nbytes)))
    finally:
        repo.close()

