"""Float compression in the write and read paths (the codec itself: test_floatcodec.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ciuic import ConfigurationError, SnapshotManager, StateHolder
from ciuic.chain.read import chunk_refs, read_body
from ciuic.chain.repo import Repository
from ciuic.chain.verify import verify_job
from ciuic.engine.compression import (
    PAGE_CACHE_S_PER_BYTE,
    REVISIT,
    CompressionPolicy,
    compression_pays,
    restore_pays,
)
from ciuic.format import chunks as ck
from ciuic.format import layout
from ciuic.format.crypto import generate_key_text
from ciuic.store import LocalStore
from tests.helpers.stored import flip, stored_form


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w32": torch.randn(300_000, generator=g) * 0.02,
            "w16": (torch.randn(200_000, generator=g) * 0.02).to(torch.bfloat16),
            "ids": torch.arange(100_000),  # not floats: never compressed
            "small": torch.randn(100, generator=g)}


def chunk_headers(store_dir: Path) -> dict[str, tuple[int, int, int]]:
    """digest -> (codec, cipher, stored bytes) of every chunk of the latest snapshot."""
    repo = Repository.open(store_dir)
    info = repo.catalog.latest("p", "default")
    assert info is not None
    _, states = read_body(repo, info)
    out = {}
    for d, ref in chunk_refs(states).items():
        blob = stored_form(repo.store, ref)
        out[d] = (blob[5], blob[6], len(blob))
    return out


def save_and_restore(store: Path, **kw: object) -> dict[str, torch.Tensor]:
    s = state()
    with SnapshotManager("p", store=store, handle_signals=False, **kw) as m:
        m.save(1, s=StateHolder(s))
    back = StateHolder()
    with SnapshotManager("p", store=store, handle_signals=False) as m:
        assert m.restore(s=back) == 1
    for name, t in s.items():
        assert back.state[name].dtype == t.dtype
        assert torch.equal(back.state[name].view(torch.uint8), t.view(torch.uint8)), name
    return back.state


def test_compressed_snapshots_restore_bit_exact_and_are_smaller(store_dir: Path) -> None:
    save_and_restore(store_dir, compression="on")
    headers = chunk_headers(store_dir)
    codecs = sorted(h[0] for h in headers.values())
    assert codecs.count(ck.CODEC_FLOAT) == 2  # w32 and w16; ids, small and RNG states: raw
    floats = [h[2] for h in headers.values() if h[0] == ck.CODEC_FLOAT]
    raw = 300_000 * 4 + 200_000 * 2
    assert sum(floats) < 0.85 * raw
    assert verify_job(Repository.open(store_dir), "p", "default", deep=True).ok


def test_compression_off_writes_raw_chunks(store_dir: Path) -> None:
    save_and_restore(store_dir, compression="off")
    assert {h[0] for h in chunk_headers(store_dir).values()} == {ck.CODEC_RAW}


def test_compression_under_encryption(store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", generate_key_text())
    save_and_restore(store_dir, compression="on", encryption=True)
    headers = chunk_headers(store_dir)
    assert {h[1] for h in headers.values()} == {1}  # every chunk sealed
    assert sorted(h[0] for h in headers.values()).count(ck.CODEC_FLOAT) == 2


def test_auto_compresses_only_where_the_store_is_slow(tmp_path: Path) -> None:
    class FastDisk(LocalStore):
        def write_speed(self, measure: bool = True) -> tuple[float, float | None]:
            return 1e12, 1e12  # faster than any codec: compressing only costs time

        def read_speed(self) -> float | None:
            return 1e12

    class SlowDisk(LocalStore):
        def write_speed(self, measure: bool = True) -> tuple[float, float | None]:
            return 1e6, 1e6  # a slow link: a 300x margin over the codec, even on a busy CI box

        def read_speed(self) -> float | None:
            return 1e6

    found = {}
    for name, store in (("fast", FastDisk), ("slow", SlowDisk)):
        with SnapshotManager("p", store=store(tmp_path / name / "objects"), handle_signals=False,
                             compression="auto") as m:
            m.save(1, s=StateHolder(state()))
            repo = m.repo
            info = repo.catalog.latest("p", "default")
            assert info is not None
            _, states = read_body(repo, info)
            found[name] = [stored_form(repo.store, r)[5] for r in chunk_refs(states).values()]
            assert m._pipeline.compression.basis["f32"]["compress"] == (name == "slow")
    assert ck.CODEC_FLOAT not in found["fast"]
    assert found["slow"].count(ck.CODEC_FLOAT) == 2


@pytest.mark.parametrize(("where", "encode_gbps", "workers", "store_gbps", "pays"), [
    # fp32 weights: ratio 0.835, BLAKE3 4.6 GB/s a core; the codec's speed as the writer
    # measured it inside its own pipeline (docs/benchmarks.md)
    ("development VM: 2 busy cores, a 1.7 GB/s disk", 0.64, 2, 1.7, False),
    ("development VM: 2 idle cores, a 1.7 GB/s disk", 1.71, 2, 1.7, False),
    ("H200 machine: 4 writers on 16 cores, a 1.04 GB/s disk", 1.4, 4, 1.04, True),
    ("object storage: 4 connections of 50 MB/s", 0.64, 2, 0.2, True),
    ("memory", 1.4, 2, 400.0, False),
])
def test_the_pipeline_model_decides_as_measured(where: str, encode_gbps: float, workers: int,
                                                store_gbps: float, pays: bool) -> None:
    ns = 1e-9
    assert compression_pays(0.835, ns / encode_gbps, ns / 4.6, PAGE_CACHE_S_PER_BYTE, workers,
                            store_gbps * 1e9) is pays, where


def test_incompressible_data_is_never_compressed_however_slow_the_store() -> None:
    assert not compression_pays(0.99, 1e-9, 1e-10, 1e-10, 4, 1e3)


def test_a_local_disk_measures_its_speed_once(tmp_path: Path) -> None:
    from ciuic.store import local

    local._speeds.clear()
    local._read_speeds.clear()
    store = LocalStore(tmp_path / "objects")
    # a multi-rank job's other ranks do not measure: the default, nothing written
    assert store.write_speed(measure=False) == (store.write_bytes_per_s, None)
    assert not local._speeds
    per_writer, total = store.write_speed()
    assert per_writer == total and 1e6 < per_writer < 1e12
    assert not list((tmp_path / "objects").iterdir())  # the probe file is gone
    read = store.read_speed()  # a cold read of the probe's file, measured with it
    assert read is not None and 1e6 < read < 1e12
    probe, local.PROBE_BYTES = local.PROBE_BYTES, 0  # a second probe would measure 0
    try:
        assert LocalStore(tmp_path / "again").write_speed() == (per_writer, total)
    finally:
        local.PROBE_BYTES = probe
    assert LocalStore(tmp_path / "x", fsync=False).write_speed()[1] is None


def test_the_disk_probe_waits_for_the_first_step(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The write-speed probe (written, fsync'ed and read back cold) starts at the run's first
    step(), not when the manager is built: a resume's restore reads the disk alone."""
    import threading

    from ciuic.store import local

    monkeypatch.setattr(local, "_speeds", {})  # not measured yet in this process
    monkeypatch.setattr(local, "_read_speeds", {})
    monkeypatch.setattr(local, "PROBE_BYTES", 8 * 1024 * 1024)
    probed = threading.Event()
    real = LocalStore._probe

    def probe(self: LocalStore) -> tuple[float, float | None] | None:
        probed.set()
        return real(self)

    monkeypatch.setattr(LocalStore, "_probe", probe)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    with SnapshotManager("p", job="j", store=tmp_path / "s", handle_signals=False) as m:
        assert m.config.compression == "auto"
        assert m.restore(model, opt) is None
        assert not probed.wait(1.0), "the disk was probed before the first step()"
        m.step(1, model, opt)
        assert probed.wait(30), "the first step() did not start the probe"
        for _ in range(300):  # until it is done (it writes in the store's folder)
            if local._speeds:
                break
            threading.Event().wait(0.1)
        assert local._speeds


def test_a_damaged_compressed_chunk_is_caught(store_dir: Path) -> None:
    save_and_restore(store_dir, compression="on")
    d, (_, _, n) = next((d, h) for d, h in chunk_headers(store_dir).items()
                        if h[0] == ck.CODEC_FLOAT)
    with Repository.open(store_dir) as repo:
        info = repo.catalog.latest("p", "default")
        assert info is not None
        ref = chunk_refs(read_body(repo, info)[1])[d]
    flip(store_dir, ref, n // 2, 0x10)  # inside the compressed payload
    report = verify_job(Repository.open(store_dir), "p", "default", deep=True)
    assert not report.ok
    assert layout.chunk_key(d) in str(report.problems)


def test_bad_compression_mode_is_refused(store_dir: Path) -> None:
    with pytest.raises(ConfigurationError, match="compression must be one of"):
        SnapshotManager("p", store=store_dir, compression="zip")


def test_auto_follows_what_the_writes_take_when_the_probe_is_wrong(tmp_path: Path) -> None:
    class MisprobedDisk(LocalStore):
        def write_speed(self, measure: bool = True) -> tuple[float, float | None]:
            return 1e6, 1e6  # a probe that misread this disk as a slow link

        def read_speed(self) -> float | None:
            return 1e6

    g = torch.Generator().manual_seed(1)
    s = {f"w{i}": torch.randn(2_000_000, generator=g) * 0.02 for i in range(3)}  # 24 MB
    codecs = []
    with SnapshotManager("p", store=MisprobedDisk(tmp_path / "objects"), handle_signals=False,
                         compression="auto") as m:
        policy = m._pipeline.compression
        for step in range(1, 4):
            for t in s.values():  # every chunk new: full snapshots
                t.add_(1e-3)
            m.save(step, s=StateHolder(s))
            info = m.repo.catalog.latest("p", "default")
            assert info is not None
            _, states = read_body(m.repo, info)
            codecs.append({stored_form(m.repo.store, r)[5]
                           for r in chunk_refs(states).values()})
            if step == 1:  # the probe's choice, then raw to measure it
                assert ck.CODEC_FLOAT in codecs[0]
                assert "measuring raw" in m.stats.compression
        raw, packed = policy.cost[False], policy.cost[True]
    assert codecs[1] == {ck.CODEC_RAW}
    chose = packed < 0.95 * raw and policy._restores_keep_pace(1 / raw)
    assert (ck.CODEC_FLOAT in codecs[2]) is chose
    assert m.stats.compression.startswith(f"auto: {'compress' if chose else 'raw'} (measured ")
    assert "s/GiB raw against" in m.stats.compression


def snapshots_of(seed: int, big: int) -> tuple[CompressionPolicy, Callable[[float], bool]]:
    """A policy whose probe says compress (a 1 MB/s store), and ``snapshot(seconds)``: one
    snapshot of ``big`` new bytes that took ``seconds``, returning whether it compressed."""
    policy = CompressionPolicy("auto", (1e6, 1e6))
    g = torch.Generator().manual_seed(seed)
    piece = memoryview((torch.randn(1 << 18, generator=g) * 0.02).numpy().tobytes())

    def snapshot(seconds: float) -> bool:
        policy.start_snapshot()
        compressed = policy.encode(("f32", 4), piece) is not None
        policy.observe(big, seconds)
        return compressed

    return policy, snapshot


def test_auto_revisits_the_choice_it_did_not_take() -> None:
    policy, snapshot = snapshots_of(2, 64 << 20)
    assert snapshot(2.0)  # the model's choice
    assert not snapshot(1.0)  # measuring raw: cheaper
    taken = [snapshot(1.0 if not policy._forced else 2.0) for _ in range(REVISIT + 2)]
    assert taken.count(True) == 1  # compressed once more to measure it again, then raw
    assert policy.choice == "auto: raw (measured 16.00 s/GiB raw against 32.00 s/GiB compressed)"
    before = dict(policy.cost)
    policy.observe(1024, 0.001)  # too small a snapshot to say anything about the store
    assert policy.cost == before
    assert not snapshot(4.0)  # the disk got slower for raw writes ...
    assert snapshot(2.0)  # ... so compressed, now cheaper per byte, is taken from the next on


def test_auto_never_compresses_what_restores_would_wait_to_decode() -> None:
    """Compressed writes measured cheaper, but on a store so fast that a restore would wait on
    the decoder (reading and decoding compressed chunks more than 5 % slower than reading and
    hashing raw ones): raw, and the choice says why."""
    policy, snapshot = snapshots_of(3, 1 << 30)
    assert snapshot(0.01)  # the probe's choice: 0.01 s/GiB, far faster than any decoder
    assert not snapshot(0.02)  # raw, measured: twice the compressed cost per byte
    assert not snapshot(0.02) and not policy._forced
    assert "a restore would wait on the decoder" in policy.choice
    assert not policy._restores_keep_pace(1 / policy.cost[False])


@pytest.mark.parametrize(("where", "read_gbps", "cores", "pays"), [
    ("the 2-core development VM, a disk read at 1 GB/s", 1.0, 2, False),
    ("a 16-core GPU machine, a disk read at 1 GB/s", 1.0, 16, True),
    ("a 16-core GPU machine, an NVMe read at 3 GB/s", 3.0, 16, False),
    ("object storage at 0.15 GB/s, 2 cores", 0.15, 2, True),
])
def test_the_restore_side_of_the_decision(where: str, read_gbps: float, cores: int,
                                          pays: bool) -> None:
    """fp32 weights (ratio 0.835), decoded at 0.8 GB/s and hashed at 2.5 GB/s a core: a
    restore must not take more than 5 % longer compressed than raw."""
    assert restore_pays(0.835, 1 / 0.8e9, 1 / 2.5e9, cores, read_gbps * 1e9) is pays, where
