"""Chunks between nodes (``ciuic.supervisor.peers``): two supervisors' holders on this machine's
loopback, as two nodes. A commit's chunks reach the next node as a replica, checked on arrival;
a node's memory is read only with the job's token; a replica serves the chunks of a node that
is gone; unchanged chunks are not sent again."""

from __future__ import annotations

import contextlib
import gc
import logging
import mmap
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ciuic.chain.repo import Repository
from ciuic.format.chunks import frame
from ciuic.format.descriptor import ChunkRef
from ciuic.format.digest import digest
from ciuic.format.layout import chunk_key
from ciuic.restore.sources import Resident, read_from
from ciuic.supervisor.channel import Link
from ciuic.supervisor.fetched import NodeReads
from ciuic.supervisor.holder import Holder
from ciuic.supervisor.peers import Node, PeerClient, PeerError, PeerReader

SKEW = 16
TOKEN = "a" * 32


def _publish(holder: Holder, rank: int, sid: str, pieces: list[bytes], buffer_id: int = 1
             ) -> list[str]:
    """A rank of ``holder``'s node stages ``pieces`` into one shared buffer and publishes
    them as the chunks it wrote; returns their digests."""
    link = Link(holder.name, rank, holder.secret)
    nbytes = sum(len(p) for p in pieces)
    fd = os.memfd_create("ciuic:test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SKEW + nbytes)
    with mmap.mmap(fd, SKEW + nbytes) as region:
        region[SKEW:] = b"".join(pieces)
    assert link.request({"op": "put", "id": buffer_id, "path": "p", "nbytes": nbytes},
                        [fd])[0]["ok"]
    os.close(fd)
    chunks, at = [], 0
    for p in pieces:
        chunks.append([digest(p), len(p), buffer_id, at])
        at += len(p)
    reply, _ = link.request({"op": "publish", "snapshot": sid, "step": 1, "ids": [buffer_id],
                             "chunks": chunks})
    assert reply["ok"], reply
    link.close()
    return [c[0] for c in chunks]


def _join(holders: list[Holder], token: str = TOKEN) -> list[Node]:
    nodes = []
    for g, h in enumerate(holders):
        port = Link(h.name, 0, h.secret).request({"op": "listen"})[0]["port"]
        nodes.append(Node(g, "127.0.0.1", port))
    for g, h in enumerate(holders):
        reply, _ = Link(h.name, 0, h.secret).request({
            "op": "peers", "token": token, "me": g,
            "nodes": [[n.rank, n.host, n.port] for n in nodes]})
        assert reply["ok"]
    return nodes


def _wait(cond: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError("timed out")


@pytest.fixture(name="two")
def two_holders() -> Iterator[list[Holder]]:
    holders = [Holder(budget=64 << 20), Holder(budget=64 << 20)]
    yield holders
    for h in holders:
        h.close()


def test_a_commit_reaches_the_next_node_and_serves_when_its_node_is_gone(
        memfds_before: set[tuple[str, str]], two: list[Holder]) -> None:
    nodes = _join(two)
    # a chunk far larger than a socket's send buffer: the push waits for the receiver
    pieces = [os.urandom(100_000), os.urandom(50_000), b"\x07" * 4096, os.urandom(24 << 20)]
    ds = _publish(two[0], 0, "s1", pieces)
    _wait(lambda: 0 in two[1].replicas.by_src and two[0].pushed)  # (noted after the reply)
    assert sorted(two[1].replicas.by_src[0].chunks) == sorted(ds)
    assert two[0].pushed[-1] == (1, 4, sum(len(p) for p in pieces))
    # the replica is in node 1's index for its own ranks, mapped like a rank's buffers
    index = Link(two[1].name, 0, two[1].secret).request({"op": "chunks"})[0]
    assert {c[0] for c in index["chunks"] if c[2] == -1} == set(ds)
    fds = Link(two[1].name, 0, two[1].secret).descriptors([index["buffers"][0][1]], owner=-1)
    assert len(fds) == 1
    os.close(fds[0])
    # node 0 is gone: a replacement (node 0 again, empty memory) reads node 1's replica
    two[0].close()
    reader = PeerReader([nodes[1]], me=0, token=TOKEN)
    for d, p in zip(ds, pieces, strict=True):
        dest = bytearray(len(p))
        assert reader.read(d, memoryview(dest)) and bytes(dest) == p
    assert not reader.read("0" * 64, memoryview(bytearray(10)))
    reader.close()
    two[1].close()
    # nothing of theirs stays open in this process (each get had a descriptor, which its
    # thread closes once the bytes are sent)
    _wait(lambda: not _open_memfds(memfds_before))


def test_unchanged_chunks_are_not_sent_again_and_a_wrong_token_reads_nothing(
        two: list[Holder]) -> None:
    nodes = _join(two)
    same, first = os.urandom(200_000), os.urandom(30_000)
    _publish(two[0], 0, "s1", [same, first])
    _wait(lambda: len(two[0].pushed) == 1)
    _publish(two[0], 0, "s2", [same, os.urandom(30_000)], buffer_id=2)
    _wait(lambda: len(two[0].pushed) == 2)
    assert two[0].pushed[1] == (1, 1, 30_000)  # only the changed chunk travelled
    assert digest(first) not in two[1].replicas.by_src[0].chunks  # the old replica's is gone
    with pytest.raises(PeerError, match="refused this job's token"):
        PeerClient(nodes[0], "b" * 32)


def test_a_chunk_that_arrives_damaged_is_refused_and_the_replica_never_serves(
        two: list[Holder]) -> None:
    nodes = _join(two)
    good = os.urandom(10_000)
    client = PeerClient(nodes[1], TOKEN, me=0)
    missing = client.call({"op": "put_begin", "src": 0, "sid": "s",
                           "entries": [[digest(good), len(good)]]})["missing"]
    assert missing == [[digest(good), len(good)]]
    with pytest.raises(PeerError, match="other bytes than its digest names"):
        client.call({"op": "put", "d": digest(good), "n": len(good)}, b"\x00" * len(good))
    client.close()
    time.sleep(0.2)
    assert two[1].replicas.by_src == {} and two[1].replicas.abandoned == 1


def test_a_replica_over_the_budget_is_refused_and_training_memory_is_kept() -> None:
    a, b = Holder(budget=64 << 20), Holder(budget=100_000)
    try:
        _join([a, b])
        _publish(a, 0, "s1", [os.urandom(150_000)])
        time.sleep(a.SETTLE_S + 1.0)
        assert b.replicas.by_src == {} and not a.pushed
        assert b.released is None  # its own ranks' copy is not released for a replica
    finally:
        a.close()
        b.close()


def test_a_replica_is_said_once_then_only_when_that_changes(
        caplog: pytest.LogCaptureFixture) -> None:
    """``ciuic run`` says at INFO that a node holds this node's replica the first time, not at
    every snapshot (DEBUG), and again at INFO when it changes: a replica refused (over the
    other node's budget), then one sent again."""
    caplog.set_level(logging.DEBUG, logger="ciuic.run")
    a, b = Holder(budget=64 << 20), Holder(budget=100_000)
    try:
        _join([a, b])
        said: list[tuple[int, str]] = []

        def publish(sid: str, nbytes: int, buffer_id: int) -> None:
            _publish(a, 0, sid, [os.urandom(nbytes)], buffer_id=buffer_id)
            _wait(lambda: len([r for r in caplog.records if "replica" in r.message])
                  > len(said))
            said[:] = [(r.levelno, "sent" if "holds a replica" in r.message else "not sent")
                       for r in caplog.records if "replica" in r.message]

        publish("s1", 10_000, 1)
        publish("s2", 10_000, 2)
        publish("s3", 150_000, 3)  # over node 1's budget: refused
        publish("s4", 10_000, 4)
        assert said == [(logging.INFO, "sent"), (logging.DEBUG, "sent"),
                        (logging.INFO, "not sent"), (logging.INFO, "sent")]
        assert "the next ones are said only if one is not sent" in caplog.records[0].message
    finally:
        a.close()
        b.close()


def test_ciuic_run_advises_torchrun_restarts_on_several_nodes() -> None:
    from ciuic.cli.run import torchrun_advice

    several = ["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "train.py"]
    assert "--max-restarts 0" in str(torchrun_advice(several))
    assert "--max-restarts 0" in str(torchrun_advice(
        ["python", "-m", "torch.distributed.run", "--nnodes=1:4", "--max_restarts=0", "t.py"]))
    assert torchrun_advice([*several[:-1], "--max-restarts", "100", "train.py"]) is None
    assert torchrun_advice(["torchrun", "--nproc-per-node", "8", "train.py"]) is None  # 1 node
    assert torchrun_advice(["python", "train.py", "--nnodes", "2"]) is None  # not torchrun
    assert torchrun_advice([*several[:-1], "--max_restarts=3", "train.py"]) is None


def test_the_nodes_own_copy_comes_before_other_nodes_replicas_within_the_budget() -> None:
    """--host-memory bounds a node's ranks' buffers and the replicas it keeps together: a rank's
    buffer that would not fit beside them drops the replicas (this node's own copy first), and
    the ranks' copy is kept."""
    a, b = Holder(budget=64 << 20), Holder(budget=1 << 20)
    try:
        _join([a, b])
        _publish(a, 0, "s1", [os.urandom(600_000)])
        _wait(lambda: 0 in b.replicas.by_src)
        _publish(b, 0, "t1", [os.urandom(600_000)])  # 1.2 MB with the replica: over 1 MiB
        with b._lock:
            held = b._ranks_held() + b.replicas.held()
        assert b.replicas.by_src == {} and b.released is None and held <= 1 << 20
        assert b.copies()[0][0] == "t1"
    finally:
        a.close()
        b.close()


@contextlib.contextmanager
def _fetching(tmp: Path, budget: int) -> Iterator[tuple[Holder, Holder, Callable[
        [list[bytes]], Repository]]]:
    """Node 0 and node 1 (``budget``: node 1's --host-memory), no replicas between them (node 1
    is a replaced node: its memory is empty), and a store to put chunks in (where a chunk
    memory cannot serve is read)."""
    a, b = Holder(budget=64 << 20, replicas=0), Holder(budget=budget, replicas=0)
    repos: list[Repository] = []

    def stored(pieces: list[bytes]) -> Repository:
        repos.append(repo := Repository.open(tmp / "store"))
        for p in pieces:
            repo.store.put(chunk_key(digest(p)), frame(p))
        return repo

    try:
        _join([a, b])
        yield a, b, stored
    finally:
        for repo in repos:
            repo.close()
        a.close()
        b.close()


def _memfds() -> set[tuple[str, str]]:
    """The ciuic memfds this process holds open (descriptor, target)."""
    held = set()
    for f in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # (closed meanwhile)
            held.add((f, os.readlink(f"/proc/self/fd/{f}")))
    return {(f, target) for f, target in held if "memfd:ciuic" in target}


@pytest.fixture
def memfds_before() -> set[tuple[str, str]]:
    """Those open before the test: an earlier test's (another module's mmap, which holds a
    descriptor of its own until it is collected) are not this test's to close."""
    gc.collect()
    return _memfds()


def _open_memfds(before: set[tuple[str, str]]) -> list[str]:
    """The ciuic memfds opened since ``before`` and still open."""
    return sorted(target for _, target in _memfds() - before)


def _restore_on(res: Resident, repo: Repository, pieces: list[bytes]) -> list[bytes]:
    """One rank's restore of ``pieces`` (4 reading threads, as boxread's pool)."""
    outs = [bytearray(len(p)) for p in pieces]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: read_from(repo, res, ChunkRef(digest(pieces[i]),
                                                              len(pieces[i])),
                                          memoryview(outs[i])), range(len(pieces))))
    return [bytes(o) for o in outs]


def test_the_ranks_of_a_node_take_each_chunk_across_the_network_once(
        memfds_before: set[tuple[str, str]], tmp_path: Path) -> None:
    """A replaced node (empty memory) whose two ranks need the same chunks, which node 0
    holds: node 1's ciuic run fetches each once (node 0's server counts its gets), both ranks
    get every byte, the bytes that crossed the network count as other nodes' memory and the
    second rank's as this node's; a chunk damaged in node 0's memory is refused by each rank
    (its digest) and read from the store; a newer publish drops the fetched chunks; nothing
    stays open."""
    with _fetching(tmp_path, 64 << 20) as (a, b, stored):
        pieces = [os.urandom(300_000) for _ in range(8)] + [os.urandom(3 << 20)]
        ds = _publish(a, 0, "s1", pieces)
        repo = stored(pieces)
        r = a._ranks[0]  # damage the third chunk in node 0's memory
        with mmap.mmap(r.buffers[1].fd, SKEW + r.buffers[1].nbytes) as region:
            at = SKEW + 2 * 300_000 + 1000
            region[at:at + 8] = b"\xff" * 8
        readers = [NodeReads(b.name, rank, b.secret) for rank in (0, 1)]
        ranks = [Resident(None, {}, None, {}, reader) for reader in readers]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda res: _restore_on(res, repo, pieces), ranks))
        assert got == [pieces, pieces]
        assert a._server is not None and a._server.served == len(ds)  # once each, not twice
        total, bad = sum(map(len, pieces)), len(pieces[2])
        assert sum(x.from_peers for x in ranks) == total - bad  # crossed the network once
        assert sum(x.from_memory for x in ranks) == total - bad  # the other rank's: the node's
        assert [x.from_store for x in ranks] == [bad, bad]  # refused by each rank
        with b._lock:
            assert b.fetched.held() == total
        _publish(b, 0, "s2", [os.urandom(1000)])  # the next snapshot: they served their restore
        with b._lock:
            assert b.fetched.held() == 0
        for reader in readers:
            reader.close()
    assert not _open_memfds(memfds_before)


def test_a_fetched_chunk_over_the_budget_is_handed_over_and_not_kept(
        memfds_before: set[tuple[str, str]], tmp_path: Path) -> None:
    with _fetching(tmp_path, 1 << 20) as (a, b, stored):
        pieces = [os.urandom(3 << 20)]
        _publish(a, 0, "s1", pieces)
        reader = NodeReads(b.name, 0, b.secret)
        res = Resident(None, {}, None, {}, reader)
        assert _restore_on(res, stored(pieces), pieces) == pieces
        assert res.from_peers == 3 << 20
        with b._lock:
            assert b.fetched.held() == 0
        reader.close()
    assert not _open_memfds(memfds_before)


def test_ciuic_run_shortens_the_c10d_keep_alive_unless_the_user_set_it() -> None:
    from ciuic.cli.run import KEEP_ALIVE, with_keep_alive

    added = ",".join(f"{k}={v}" for k, v in KEEP_ALIVE.items())
    base = ["torchrun", "--nnodes", "2", "--rdzv-backend", "c10d"]
    command, said = with_keep_alive([*base, "--rdzv-conf", "is_host=1", "train.py", "--x"])
    assert command == [*base, "--rdzv-conf", f"is_host=1,{added}", "train.py", "--x"]
    assert said is not None and "instead of torch's 15 s" in said
    command, _ = with_keep_alive(["python", "-m", "torch.distributed.run", "--nnodes=1:4",
                                  "--rdzv_backend=c10d", "--rdzv_conf=is_host=0", "t.py"])
    assert command[-2] == f"--rdzv_conf=is_host=0,{added}"
    command, _ = with_keep_alive([*base, "train.py"])
    assert command == ["torchrun", "--rdzv-conf", added, *base[1:], "train.py"]
    for kept in ([*base, "--rdzv-conf", "keep_alive_max_attempt=9", "t.py"],  # the user's
                 ["torchrun", "--nnodes", "2", "t.py"],  # static rendezvous: no keep-alive
                 ["torchrun", "--nproc-per-node", "8", "--rdzv-backend", "c10d", "t.py"],
                 ["python", "t.py", "--nnodes", "2", "--rdzv-backend", "c10d"]):
        assert with_keep_alive(kept) == (kept, None)


def test_ciuic_run_gives_a_torchrun_of_several_nodes_its_own_rendezvous_store_keys(
        tmp_path: Path) -> None:
    """torch 2.13's agents share the rendezvous store unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE
    is 1; then a replaced node makes every torchrun exit after 60 s (tests/test_multinode.py).
    ``ciuic run`` sets it for a torchrun of several nodes with c10d, says so, leaves a value the
    user set (with a warning where it is not 1), and sets nothing for one node. The command
    is a script named torchrun that writes what its environment holds."""
    import subprocess
    import sys

    name = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    seen = tmp_path / "seen"
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(f"#!{sys.executable}\nimport os\nopen({str(seen)!r}, 'a').write("
                        f"repr(os.environ.get({name!r})) + '\\n')\n")
    torchrun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != name}

    def run(*args: str, **extra: str) -> str:
        done = subprocess.run([sys.executable, "-m", "ciuic", "run", "--host-memory", "off", "--",
                               str(torchrun), *args, "train.py"], env={**env, **extra},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stderr

    several = ("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400")
    said = run(*several)
    assert f"{name}=1 is set in its environment" in said
    said = run(*several, **{name: "0"})
    assert f"[WARNING] ciuic run: {name}=0 in the environment" in said
    assert "unset it, or set" in said
    run("--nproc-per-node", "2")  # one node: nothing set
    run(*several, **{name: "1"})  # the user's, as it is
    assert seen.read_text().splitlines() == ["'1'", "'0'", "None", "'1'"]
