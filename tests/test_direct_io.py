"""Direct I/O in the local store (store/direct.py): chunks of staged tensors reach the disk
without the page cache, every other object is written buffered, and a file system or device
that refuses direct I/O gets every byte all the same."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from ciuic import SnapshotManager, knobs
from ciuic.engine import staging
from ciuic.format import chunks as ck
from ciuic.store import LocalStore
from ciuic.store import direct as dio
from tests.models import model_opt

pytestmark = pytest.mark.skipif(not dio.FLAG, reason="no O_DIRECT on this platform")


def _direct_works(directory: Path) -> bool:
    """Whether this file system accepts O_DIRECT (tmpfs before Linux 6.6 does not)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, direct = dio.open_for(directory / "probe", True)
    os.close(fd)
    os.unlink(directory / "probe")
    return direct


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    if not _direct_works(root):
        pytest.skip(f"{tmp_path} is on a file system without direct I/O")
    return root


def _staged(nbytes: int, seed: int = 0) -> torch.Tensor:
    """A staging buffer (as staging allocates them) holding random bytes."""
    buf = staging.allocate_host(nbytes)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(seed)))
    return buf


def _cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore)."""
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        libc = ctypes.CDLL(None, use_errno=True)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        return sum(v & 1 for v in vec)


def test_staging_buffers_line_a_chunk_up_with_pages() -> None:
    for n in (1, 4096, 5 << 20):
        buf = staging.allocate_host(n)
        assert buf.numel() == n
        assert buf.data_ptr() % mmap.PAGESIZE == staging.SKEW == ck.HEADER_BYTES


@pytest.mark.parametrize("nbytes", [4 << 20, (4 << 20) + 123, 1 << 20, (2 << 20) + 4080,
                                    (3 << 20) - 16])
def test_a_staged_chunk_is_written_direct_and_reads_back(disk: Path, nbytes: int) -> None:
    store = LocalStore(disk)
    buf = _staged(nbytes)
    piece = memoryview(buf.numpy())
    data = ck.frame(piece)
    store.put("chunks/aa/x", data, durable=False)
    store.sync()
    size = ck.HEADER_BYTES + nbytes
    aligned = (nbytes - (dio.BLOCK - ck.HEADER_BYTES)) // dio.BLOCK * dio.BLOCK + dio.BLOCK
    assert store.direct and store.direct_bytes == aligned
    path = disk / "chunks" / "aa" / "x"
    assert path.stat().st_size == size
    assert path.read_bytes() == bytes(data[0]) + buf.numpy().tobytes()
    # a fresh write's direct part never went through the page cache (the read above brought
    # this one's pages in)
    store.put("chunks/aa/y", data, durable=False)
    store.sync()
    assert _cached_pages(disk / "chunks" / "aa" / "y") <= 1  # at most the buffered last page


def test_objects_that_do_not_line_up_are_written_buffered(disk: Path) -> None:
    store = LocalStore(disk)
    loose = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)  # torch's own alignment
    if (loose.data_ptr() + dio.BLOCK - ck.HEADER_BYTES) % dio.BLOCK == 0:
        loose = loose[1:]
    small = _staged(64 << 10)
    big_bytes = bytes(_staged(2 << 20).numpy())  # read-only: its address is not taken
    for key, data in (("a", ck.frame(memoryview(loose.numpy()))),
                      ("b", ck.frame(memoryview(small.numpy()))),
                      ("c", big_bytes), ("d", [b"h" * 5000, memoryview(_staged(2 << 20).numpy())])):
        store.put(f"o/{key}", data)
        want = b"".join(bytes(p) for p in data) if isinstance(data, list) else bytes(data)
        assert store.get(f"o/{key}") == want
    assert store.direct_bytes == 0 and store.direct  # nothing refused: nothing lined up


def test_the_knob_turns_direct_io_off(disk: Path) -> None:
    store = LocalStore(disk)
    with knobs.override(direct_io=False):
        store.put("o/x", ck.frame(memoryview(_staged(2 << 20).numpy())))
    assert store.direct_bytes == 0


def test_a_file_system_without_direct_io_gets_every_byte() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    root = Path(tempfile.mkdtemp(prefix="direct-io-test-", dir=shm))
    try:
        if _direct_works(root):  # tmpfs has direct I/O since Linux 6.6
            pytest.skip("this kernel's tmpfs accepts O_DIRECT: no file system here refuses it")
        store = LocalStore(root)
        buf = _staged(2 << 20)
        data = ck.frame(memoryview(buf.numpy()))
        store.put("o/x", data)
        assert not store.direct and store.direct_bytes == 0
        assert store.get("o/x") == bytes(data[0]) + buf.numpy().tobytes()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_refused_alignment_writes_the_object_buffered(disk: Path) -> None:
    """A device that refuses a direct write's alignment (EINVAL) loses nothing: given a body
    that is not on a page boundary, the kernel refuses, and the whole object goes buffered."""
    buf = _staged(3 << 20)
    whole = memoryview(buf.numpy())
    first = memoryview(bytearray(dio.BLOCK))
    body, rest = whole[1:1 + (2 << 20)], whole[1 + (2 << 20):]  # off by one byte
    path = disk / "refused"
    fd, direct = dio.open_for(path, True)
    assert direct
    try:
        assert dio.write(fd, (first, body, rest)) == 0
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(first) + bytes(body) + bytes(rest)


def test_a_snapshot_of_staged_tensors_goes_direct_and_restores_bit_exact(disk: Path) -> None:
    model, opt = model_opt(1024, 1024, 700, optimizer=torch.optim.Adam)
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with SnapshotManager("p", job="j", store=disk, save_interval=1, handle_signals=False,
                         compression="off") as m:
        assert m.step(1, model, opt)
        m.wait()
        store = m._pipeline.repo.store
        while not isinstance(store, LocalStore):
            store = store.inner  # type: ignore[attr-defined]
        chunks = sum(p.stat().st_size for p in (disk / "chunks").rglob("*") if p.is_file())
        # every large chunk went direct but for its last partial page
        assert store.direct_bytes > 0.9 * chunks
    for p in model.parameters():
        p.data.zero_()
    with SnapshotManager("p", job="j", store=disk, handle_signals=False) as m:
        m.restore(model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
