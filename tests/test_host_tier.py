"""The host-memory tier across the ranks of a node (``ciuic run`` under torchrun): every rank
publishes the chunks it wrote, and a restore takes any chunk it needs from any rank's memory,
checked against its digest; the supervisor's protocol refuses what it must."""

from __future__ import annotations

import mmap
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ciuic.supervisor.channel import ENV, Link, receive, send
from ciuic.supervisor.holder import Holder
from tests.framework_runs import free_port

HELPER = Path(__file__).parent / "helpers" / "sup_train.py"

RESTORE = """
import os, sys, torch, torch.distributed as dist
from pathlib import Path
sys.path.insert(0, {helpers!r})
from torch import nn
from finalstate import write_final
from ciuic import SnapshotManager
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 4)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
m = SnapshotManager("sup", store={store!r}, save_interval=None)
assert m.restore(model, opt) == 5
if dist.get_rank() == 0:
    write_final(model.module, opt, Path(sys.argv[1]))
dist.destroy_process_group()
os._exit(0)  # like a crash: the host copy stays as it is
"""


def _torchrun(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), *args], capture_output=True, text=True,
        timeout=240, env={**os.environ, "PYTHONWARNINGS": "ignore", **env})


def _restored(tmp: Path, env: dict[str, str]) -> tuple[dict[str, torch.Tensor], str]:
    from safetensors.torch import load_file

    script = tmp / "restore.py"
    script.write_text(RESTORE.format(helpers=str(HELPER.parent), store=str(tmp / "store")))
    out = tmp / f"restored-{len(list(tmp.glob('restored-*')))}.safetensors"
    run = _torchrun(str(script), str(out), env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return load_file(str(out)), run.stderr


def _read(said: str) -> tuple[float, float]:
    """MiB read from host memory and from the store, summed over the ranks, as logged."""
    found = re.search(r"Read (.+) from host memory and (.+) from the store in [\d.]+ s "
                      r"\(all 2 ranks\)", said)
    assert found, said[-3000:]
    return _mib(found.group(1)), _mib(found.group(2))


def _mib(size: str) -> float:
    return 0.0 if size == "0 B" else float(size.removesuffix(" MiB"))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_every_rank_restores_from_the_memory_of_the_nodes_ranks(tmp_path: Path) -> None:
    holder = Holder(budget=1 << 30)  # this test is the supervisor
    try:
        env = {**holder.environment(), "CIUIC_RUN_RESTART": "0"}
        run = _torchrun(str(HELPER), "--store", str(tmp_path / "store"), "--out",
                        str(tmp_path / "out"), "--steps", "6", "--every", "5", env=env)
        assert run.returncode == 0, run.stderr[-4000:]
        copies = holder.copies()
        assert sorted(copies) == [0, 1] and {c[1] for c in copies.values()} == {5}
        from_store, said = _restored(tmp_path, {ENV: ""})
        assert "host memory" not in said
        # DDP: each rank needs the whole model, and wrote about half of it: the rest is in the
        # other rank's memory, and nothing is read from the store
        from_memory, said = _restored(tmp_path, env)
        assert "Loading snapshot from host memory (ciuic run holds" in said, said[-3000:]
        memory, store = _read(said)
        assert store == 0 and memory > 0.7, said[-3000:]  # 2 x 0.41 MiB
        _assert_same(from_memory, from_store)
        # a rank whose own copy is gone: what it wrote comes from the store, the rest from
        # the other rank's memory
        Link(holder.name, 0, holder.secret).request({"op": "invalidate"})
        partly, said = _restored(tmp_path, env)
        memory, store = _read(said)
        assert store > 0.3 and memory > 0.1, said[-3000:]
        _assert_same(partly, from_store)
        store_before = store
        # damage in rank 1's memory: caught by the digest, that chunk (128 KiB, which both
        # ranks need) comes from the store
        r1 = holder._ranks[1]
        _, n, i, off = max(r1.chunks, key=lambda c: int(c[1]))
        assert n == 128 << 10
        with mmap.mmap(r1.buffers[i].fd, 16 + r1.buffers[i].nbytes) as region:
            at = 16 + int(off)  # (a buffer starts 16 bytes into its memfd)
            region[at:at + 8] = b"\xff" * 8
        damaged, said = _restored(tmp_path, env)
        _assert_same(damaged, from_store)
        assert _read(said)[1] == pytest.approx(store_before + 0.25, abs=0.011), said[-3000:]
    finally:
        holder.close()


@pytest.fixture
def holder() -> Iterator[Holder]:
    h = Holder(budget=1 << 20)
    yield h
    h.close()


def _put(link: Link, i: int, nbytes: int) -> mmap.mmap:
    fd = os.memfd_create("ciuic:test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 16 + nbytes)
    region = mmap.mmap(fd, 16 + nbytes)
    reply, _ = link.request({"op": "put", "id": i, "path": "x", "nbytes": nbytes}, [fd])
    os.close(fd)
    assert reply["ok"], reply
    return region


def test_the_holder_publishes_only_bytes_inside_a_rank_s_own_buffers(holder: Holder) -> None:
    a, b = Link(holder.name, 0, holder.secret), Link(holder.name, 1, holder.secret)
    _put(a, 1, 4096)
    _put(b, 1, 4096)
    # a chunk past the end of its buffer, or in a buffer the rank does not hold
    reply, _ = a.request({"op": "publish", "snapshot": "s", "step": 1, "ids": [1],
                          "chunks": [["d0", 100, 1, 4000]]})
    assert not reply["ok"] and "bytes 4000..4100 of buffer 1" in reply["why"]
    reply, _ = a.request({"op": "publish", "snapshot": "s", "step": 1, "ids": [2]})
    assert not reply["ok"] and reply["why"] == "unknown buffers"
    # another rank's buffers are lent only while published
    reply, fds = b.request({"op": "fds", "ids": [1], "owner": 0})
    assert not reply["ok"] and fds == [] and "rank 0 no longer publishes" in reply["why"]
    reply, _ = a.request({"op": "publish", "snapshot": "s", "step": 1, "ids": [1],
                          "leaves": [["model/w", 1, 0, 4096]],
                          "chunks": [["d0", 2048, 1, 0], ["d1", 2048, 1, 2048]]})
    assert reply["ok"], reply
    index, _ = b.request({"op": "chunks"})
    assert index["chunks"] == [["d0", 2048, 0, 1, 0], ["d1", 2048, 0, 1, 2048]]
    assert index["buffers"] == [[0, 1, 4096]]
    fds = b.descriptors([1], owner=0)
    assert len(fds) == 1
    os.close(fds[0])
    a.request({"op": "invalidate"})  # the buffers are about to change
    assert b.request({"op": "chunks"})[0]["chunks"] == []
    with pytest.raises(ValueError, match="no longer publishes"):
        b.descriptors([1], owner=0)


def test_a_message_over_a_packet_travels_in_shared_memory() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with left, right:
        chunks = [[f"{i:064x}", 4 << 20, 1, i << 22] for i in range(4000)]  # ~330 KB of JSON
        send(left, {"op": "publish", "chunks": chunks})
        message, fds = receive(right)
        assert message == {"op": "publish", "chunks": chunks} and fds == []
