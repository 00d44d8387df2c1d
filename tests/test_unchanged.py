"""Incremental snapshots: chunks found unchanged while staging are neither copied nor hashed
again, and nothing that did change is ever missed."""

from __future__ import annotations

import itertools
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ciuic import SnapshotManager, StateHolder, faults, knobs
from ciuic.engine import unchanged
from ciuic.format import chunks as ck
from ciuic.format.crypto import ObjectCodec, generate_key_text
from tests.models import linear

CHUNK = 64 * 1024
N = 16 * CHUNK // 4  # float32 values: 16 chunks a tensor


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The sizes of the chunk-sized pieces the writer hashes."""
    sizes: list[int] = []
    name = ObjectCodec.name

    def counting(self: ObjectCodec, data: object) -> str:
        n = len(memoryview(data))  # type: ignore[arg-type]
        if n == CHUNK:
            sizes.append(n)
        return name(self, data)  # type: ignore[arg-type]

    monkeypatch.setattr(ObjectCodec, "name", counting)
    with knobs.override(chunk_bytes=CHUNK):
        yield sizes


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(N, generator=g) for k in ("a", "b", "c")}


def restored(m: SnapshotManager, **kw: str) -> dict[str, torch.Tensor]:
    holder = StateHolder({})
    m.restore(state=holder, **kw)
    return holder.state


def test_only_changed_chunks_are_copied_hashed_and_written(store_dir: Path,
                                                           hashed: list[int]) -> None:
    live = state()
    with SnapshotManager("p", job="inc", store=store_dir, compression="off") as m:
        m.save(1, state=StateHolder(live))
        assert len(hashed) == 48
        hashed.clear()
        # in place through a NumPy view (no version counter sees it), one value of chunk 3;
        # and c replaced by a new tensor
        live["b"].numpy()[3 * CHUNK // 4 + 7] += 1.0
        live["c"] = live["c"] * 2
        want = {k: v.clone() for k, v in live.items()}
        info = m.save(2, state=StateHolder(live))
        assert len(hashed) == 17  # b's chunk 3 and c's 16; a's 16 and b's 15 others reused
        assert info.new_bytes == 17 * CHUNK
        got = restored(m)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_only_changed_pieces_wait_for_a_naming_thread(store_dir: Path, hashed: list[int],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Unchanged pieces whose chunks are stored are named on the writer's own thread: the
    naming threads get only the changed ones, so an incremental snapshot's first write is not
    queued behind every unchanged piece before it."""
    from ciuic.chain import writer

    dispatched: list[int] = []  # the chunk-sized pieces handed to a naming thread
    call = writer._Namer.__call__

    def counting(self: writer._Namer, batch: list[writer._Piece]) -> Any:
        dispatched.extend(len(p.data) for p in batch if len(p.data) == CHUNK)
        return call(self, batch)

    monkeypatch.setattr(writer._Namer, "__call__", counting)
    live = state()
    with SnapshotManager("p", job="inc", store=store_dir, compression="off") as m:
        m.save(1, state=StateHolder(live))
        assert len(dispatched) == 48
        dispatched.clear()
        live["b"].numpy()[5 * CHUNK // 4] += 1.0  # b's chunk 5
        want = {k: v.clone() for k, v in live.items()}
        assert m.save(2, state=StateHolder(live)).new_bytes == CHUNK
        assert dispatched == [CHUNK] and len(hashed) == 49
        got = restored(m)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_change_in_the_last_byte_of_a_chunk_is_found(store_dir: Path,
                                                       hashed: list[int]) -> None:
    live = state()
    raw = live["a"].view(torch.uint8)
    with SnapshotManager("p", job="last", store=store_dir, compression="off") as m:
        m.save(1, state=StateHolder(live))
        raw[5 * CHUNK - 1] ^= 1  # the last byte of chunk 4
        raw[N * 4 - 1] ^= 1  # and the very last byte of the tensor
        want = live["a"].clone()
        hashed.clear()
        assert m.save(2, state=StateHolder(live)).new_bytes == 2 * CHUNK
        assert len(hashed) == 2
        assert torch.equal(restored(m)["a"], want)


def test_numpy_arrays_are_compared_too(store_dir: Path, hashed: list[int]) -> None:
    arr = np.arange(N, dtype=np.float32)
    big_endian = np.arange(N, dtype=">f4")  # stored little-endian: copied, never compared
    with SnapshotManager("p", job="np", store=store_dir, compression="off") as m:
        m.save(1, state=StateHolder({"arr": arr, "be": big_endian}))
        hashed.clear()
        arr[-1] = -1.0
        big_endian[0] = -1.0
        m.save(2, state=StateHolder({"arr": arr, "be": big_endian}))
        assert len(hashed) == 1 + 16
        got = restored(m)
    assert np.array_equal(got["arr"], arr) and np.array_equal(got["be"], big_endian)


def test_a_restore_of_older_bytes_is_snapshotted_as_those_bytes(store_dir: Path) -> None:
    """Restoring an older snapshot reads its bytes straight into the model's tensors, while
    the staging buffers still hold the newer bytes with their digests: the next snapshot
    compares the model with them byte for byte, and must store the older values, not reuse
    the newer digests."""
    model = linear(256, 256)
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with knobs.override(chunk_bytes=CHUNK), SnapshotManager(
            "p", job="back", store=store_dir, compression="off") as m:
        old = m.save(1, model)
        with torch.no_grad():
            model.weight.add_(1.0)
        m.save(2, model)  # the buffers now hold these values, with their digests
        weight = model.weight.data_ptr()
        m.restore(model, snapshot=old.id)  # the older bytes, read into the model's memory
        assert torch.equal(model.weight, first["weight"]) and model.weight.data_ptr() == weight
        assert not torch.equal(m._pipeline.staging._buffers["model/weight"].view(
            torch.float32).view(256, 256), first["weight"])  # the buffer: the newer bytes
        m.save(3, model)
        fresh = nn.Linear(256, 256)
        assert m.restore(fresh) == 3
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in first.items())


def test_a_copy_interrupted_part_way_leaves_no_stale_digest(
        store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks 0 and 5 changed; staging copies chunk 0, then is interrupted (a second Ctrl-C,
    say). The buffer's chunk 0 then holds the new bytes under the old digest, unless the
    digests were forgotten first: the next snapshot would find chunk 0 equal and name it by
    the old digest, and a restore would bring back the old values."""
    live = state()
    sync = unchanged._sync

    def interrupted(src: int, dst: int, pieces: list[unchanged.Piece], keep: object = None,
                    defer: bool = False) -> tuple[set[int], list[tuple[int, int]]]:
        for piece in pieces:
            if sync(src, dst, [piece])[0]:  # this chunk differed and was copied
                raise RuntimeError("interrupted")
        return set(), []

    with knobs.override(chunk_bytes=CHUNK), SnapshotManager(
            "p", job="intr", store=store_dir, compression="off") as m:
        m.save(1, state=StateHolder(live))
        live["a"][0] += 1.0
        live["a"][5 * CHUNK // 4] += 1.0
        monkeypatch.setattr(unchanged, "_sync", interrupted)
        with pytest.raises(RuntimeError, match="interrupted"):
            m.save(2, state=StateHolder(live))
        monkeypatch.setattr(unchanged, "_sync", sync)
        m.save(3, state=StateHolder(live))
        assert torch.equal(restored(m)["a"], live["a"])


def test_resized_tensors_get_new_buffers_without_digests(store_dir: Path) -> None:
    with knobs.override(chunk_bytes=CHUNK), SnapshotManager(
            "p", job="resize", store=store_dir, compression="off") as m:
        for step, n in enumerate((N, N // 2, N)):
            live = {"a": torch.arange(n, dtype=torch.float32) + step}
            m.save(step, state=StateHolder(live))
            assert torch.equal(restored(m)["a"], live["a"])


def test_read_only_numpy_arrays_are_staged_without_a_warning(store_dir: Path) -> None:
    arr = np.arange(N, dtype=np.float32)
    arr.flags.writeable = False
    with SnapshotManager("p", job="ro", store=store_dir, compression="off") as m:
        m.save(1, state=StateHolder({"arr": arr}))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            m.save(2, state=StateHolder({"arr": arr}))
        assert np.array_equal(restored(m)["arr"], arr)


def test_a_new_chunk_size_hashes_everything_again(store_dir: Path) -> None:
    live = state()
    with SnapshotManager("p", job="size", store=store_dir, compression="off") as m:
        with knobs.override(chunk_bytes=CHUNK):
            m.save(1, state=StateHolder(live))
        live["a"][0] = 5.0
        with knobs.override(chunk_bytes=CHUNK * 2):
            info = m.save(2, state=StateHolder(live))
            assert info.new_bytes == 3 * 16 * CHUNK  # every chunk is new at the new size
            assert all(torch.equal(v, live[k]) for k, v in restored(m).items())


def test_after_a_failed_snapshot_the_next_one_is_complete(store_dir: Path,
                                                          hashed: list[int]) -> None:
    live = state()
    with SnapshotManager("p", job="fail", store=store_dir, compression="off",
                         save_interval=1) as m:
        m.save(1, state=StateHolder(live))
        live["b"] += 1
        faults.reload("chunk.put=raise@2")  # the second chunk write fails
        assert m.step(2, state=StateHolder(live))
        m.wait()
        faults.reload("")
        assert m.stats.failures == 1 and m.latest().step == 1  # type: ignore[union-attr]
        want = {k: v.clone() for k, v in live.items()}
        info = m.save(3, state=StateHolder(live))
        assert info.step == 3
        got = restored(m)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_overlapped_copies_compare_too(store_dir: Path, hashed: list[int]) -> None:
    torch.manual_seed(0)
    model = nn.Linear(512, 512, bias=False)  # 1 MiB: 16 chunks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with SnapshotManager("p", job="ovl", store=store_dir, compression="off",
                         overlap=True, save_interval=1) as m:
        assert m.step(1, model, opt)
        m.wait()
        hashed.clear()
        with torch.no_grad():
            model.weight[-1, -1] += 1.0  # the last chunk only
        want = model.weight.detach().clone()
        assert m.step(2, model, opt)
        opt.zero_grad()
        model(torch.randn(2, 512)).sum().backward()
        opt.step()  # waits for the copy, then changes every value
        m.wait()
        assert len(hashed) == 1
        fresh = nn.Linear(512, 512, bias=False)
        assert m.restore(fresh) == 2
    assert torch.equal(fresh.weight, want)


def test_encrypted_stores_reuse_their_keyed_names(store_dir: Path, hashed: list[int],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CIUIC_ENCRYPTION_KEY", generate_key_text())
    live = state()
    with SnapshotManager("p", job="enc", store=store_dir, compression="off",
                         encryption=True) as m:
        m.save(1, state=StateHolder(live))
        hashed.clear()
        live["c"][-1] = 0.0
        assert m.save(2, state=StateHolder(live)).new_bytes == CHUNK
        assert len(hashed) == 1
        got = restored(m)
    assert all(torch.equal(got[k], live[k]) for k in live)


def test_copy_changed_compares_known_chunks_and_copies_the_rest() -> None:
    a = torch.arange(10 * 1000, dtype=torch.int32).view(torch.uint8)[:10 * 1000].clone()
    b = a.clone()
    b[2500] += 1  # chunk 2 differs; chunk 3 is unknown (copied without a compare)
    b[3100] += 1
    b[7000] += 1  # chunk 7 is unknown
    kept = unchanged.copy_changed(a.data_ptr(), b.data_ptr(), a.numel(), 1000,
                                  ["d0", "d1", "d2", None, "d4", "d5", "d6", None, "d8", "d9"])
    assert kept == ["d0", "d1", None, None, "d4", "d5", "d6", None, "d8", "d9"]
    assert torch.equal(a, b)
    c = torch.zeros_like(a)
    assert unchanged.copy_changed(a.data_ptr(), c.data_ptr(), a.numel(), 1000, None) is None
    assert torch.equal(a, c)
    with pytest.raises(ValueError, match="3 digests for 10 chunks"):
        unchanged.copy_changed(a.data_ptr(), b.data_ptr(), a.numel(), 1000, ["x"] * 3)
    assert unchanged.host_pointer(a[::2]) is None  # not contiguous
    assert unchanged.host_pointer(torch.randn(4, dtype=torch.complex64).conj()) is None
    assert unchanged.host_pointer(np.arange(4, dtype=">i4")) is None
    assert unchanged.host_pointer(torch.eye(3).to_sparse()) is None
    assert unchanged.host_pointer(a) == a.data_ptr()


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_a_large_tensor_is_compared_and_copied_on_several_threads(
        workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut into ranges per thread (a chunk may be split between two), the pass still finds
    every changed chunk, whichever byte of it changed, and no other, and leaves the
    destination equal to the source."""
    monkeypatch.setattr(unchanged, "threads", lambda: workers)
    monkeypatch.setattr(unchanged, "_pools", None)  # a pool of this size, for this test only
    rng = np.random.default_rng(workers)
    nbytes = 9 * 1024 * 1024 + 777
    a = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
    for chunk_bytes in (1024 * 1024, 3 * 1024 * 1024 + 5, 4 * 1024 * 1024, nbytes):
        pieces = ck.split(nbytes, chunk_bytes)
        for trial in range(6):
            b = a.clone()
            spots = {0, nbytes - 1, chunk_bytes - 1, chunk_bytes % nbytes}
            spots |= {int(x) for x in rng.integers(0, nbytes, trial)}
            for spot in sorted(spots)[:trial]:
                b[spot] ^= 0x40
            known = [None if rng.random() < 0.2 else f"d{i}" for i in range(len(pieces))]
            want = [d if d is not None and torch.equal(a[o:o + n], b[o:o + n]) else None
                    for (o, n), d in zip(pieces, known, strict=True)]
            for large in (False, True):  # large ranges: by the caller's copy (torch's)
                c = b.clone()
                handed: list[tuple[int, int]] = []

                def copy_large(off: int, n: int, c: torch.Tensor = c,
                               handed: list[tuple[int, int]] = handed) -> None:
                    handed.append((off, n))
                    c[off:off + n] = a[off:off + n]

                got = unchanged.copy_changed(a.data_ptr(), c.data_ptr(), nbytes, chunk_bytes,
                                             known, copy_large=copy_large if large else None)
                assert got == want, (chunk_bytes, trial, large)
                assert torch.equal(a, c)
                assert all(n >= unchanged.LARGE_COPY_BYTES for _, n in handed)
                assert all(o1 + n1 < o2 for (o1, n1), (o2, _) in itertools.pairwise(handed))
    assert any(t.name.startswith("ciuic-copy") for t in threading.enumerate())


def test_an_interrupt_returns_only_once_every_thread_has_finished_its_range(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C while the calling thread copies its range: the other threads' ranges are
    finished before the interrupt propagates, so no thread writes the buffer afterwards."""
    monkeypatch.setattr(unchanged, "threads", lambda: 4)
    monkeypatch.setattr(unchanged, "_pools", None)  # a pool of this size, for this test only
    sync = unchanged._sync

    def slow(src: int, dst: int, pieces: list[unchanged.Piece], keep: object = None,
             defer: bool = False) -> tuple[set[int], list[tuple[int, int]]]:
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        time.sleep(0.3)
        return sync(src, dst, pieces)

    monkeypatch.setattr(unchanged, "_sync", slow)
    a = torch.ones(8 * 1024 * 1024, dtype=torch.uint8)
    b = torch.zeros_like(a)
    with pytest.raises(KeyboardInterrupt):
        unchanged.copy_changed(a.data_ptr(), b.data_ptr(), a.numel(), 1 << 20, None, (a, b))
    quarter = a.numel() // 4
    assert torch.equal(a[:3 * quarter], b[:3 * quarter])  # the three other threads' ranges
    assert not b[3 * quarter:].any()  # the interrupted caller's own range


def test_balance_covers_every_byte_once() -> None:
    pieces = [(0, 0, 10, True), (2, 20, 10, False), (3, 30, 7, True)]
    for parts in range(1, 9):
        groups = unchanged._balance(pieces, 27, parts)
        assert len(groups) <= parts
        flat = [p for g in groups for p in g]
        covered = sorted((off, off + n, i) for i, off, n, _ in flat)
        assert sum(n for _, _, n, _ in flat) == 27
        for (_, end, _), (start, _, _) in itertools.pairwise(covered):
            assert end <= start
        for i, off, n, compare in flat:
            assert compare == (i != 2)
            base = {0: 0, 2: 20, 3: 30}[i]
            assert base <= off and off + n <= base + {0: 10, 2: 10, 3: 7}[i]


def test_every_snapshot_of_a_randomly_edited_state_restores_exactly(store_dir: Path) -> None:
    """Ten snapshots; between them random bytes of random chunks change in place, whole
    tensors are replaced, or nothing happens; every snapshot restores to the values of its
    call, byte for byte."""
    rng = np.random.default_rng(7)
    live: dict[str, torch.Tensor | np.ndarray] = {
        "f32": torch.randn(N), "bf16": torch.randn(2 * N).to(torch.bfloat16),
        "i64": torch.arange(N // 2), "np": np.arange(N, dtype=np.float32),
        "odd": torch.randn(N + 3),  # a partial last chunk
    }
    wanted: list[tuple[str, dict[str, bytes]]] = []
    with knobs.override(chunk_bytes=CHUNK), SnapshotManager(
            "p", job="fuzz", store=store_dir, compression="off") as m:
        for step in range(10):
            for name in rng.choice(sorted(live), size=rng.integers(0, 3), replace=False):
                value = live[name]
                raw = value.view(np.uint8) if isinstance(value, np.ndarray) else value.view(
                    -1).view(torch.uint8).numpy()
                if rng.random() < 0.2 and isinstance(value, torch.Tensor):
                    live[name] = value.clone()  # a new tensor, same values (all chunks equal)
                for at in rng.integers(0, raw.size, size=rng.integers(1, 4)):
                    raw[at] ^= 1 << int(rng.integers(0, 8))
            info = m.save(step, state=StateHolder(live))
            wanted.append((info.id, {k: _raw(v) for k, v in live.items()}))
        for sid, want in wanted:
            got = restored(m, snapshot=sid)
            assert {k: _raw(v) for k, v in got.items()} == want, sid


def _raw(value: torch.Tensor | np.ndarray) -> bytes:
    if isinstance(value, np.ndarray):
        return value.tobytes()
    return bytes(value.contiguous().view(-1).view(torch.uint8).numpy())


def test_a_large_bool_tensor_keeps_its_bytes(store_dir: Path) -> None:
    """A bool tensor viewed from bytes other than 0 and 1: a copy in its dtype makes each byte
    0 or 1, so the buffer never equalled the tensor and every snapshot copied it again."""
    raw = torch.full((6 * 1024 * 1024,), 2, dtype=torch.uint8)
    live = {"mask": raw.view(torch.bool)}
    with SnapshotManager("p", job="bool", store=store_dir, compression="off") as m:
        m.save(1, state=StateHolder(live))
        assert m.save(2, state=StateHolder(live)).new_bytes == 0
        assert torch.equal(restored(m)["mask"].view(torch.uint8), raw)
        buf = next(b for p, b in m._pipeline.staging._buffers.items() if p.endswith("mask"))
        assert torch.equal(buf, raw)  # the buffer holds the very bytes
