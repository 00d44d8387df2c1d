"""The node link of ``ciuic run --nproc-per-node N --nnodes M`` (ciuic.supervisor.fleet), on
this machine's loopback: a follower's hello, the places the leader gives, a node's loss told
at once when its end closes and after the timeout when it falls silent, what is not a node's
hello, two nodes of one rank, and a follower that loses the leader. The nodes' recoveries
themselves run on simulated nodes (tests/test_inprocess_nodes.py)."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import pytest

from ciuic.supervisor.fleet import FollowerLink, LeaderLink, Member, NodeSpec
from tests.test_supervisor import CIUIC


@pytest.fixture
def leader() -> Iterator[LeaderLink]:
    link = LeaderLink(timeout_s=1.5)
    yield link
    link.close()


def until(what: Callable[[], object], timeout: float = 5.0) -> object:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s")


def test_a_follower_joins_and_its_loss_is_told_once_as_soon_as_its_end_closes(
        leader: LeaderLink) -> None:
    follower = FollowerLink("127.0.0.1", leader.port, 1, timeout_s=5.0)
    until(lambda: leader.live())
    [m] = leader.live()
    assert (m.node_rank, m.slot, m.lost) == (1, None, None)
    assert leader.lost() == []
    t0 = time.monotonic()
    follower.close()
    lost: list[Member] = []
    until(lambda: lost.extend(leader.lost()) or lost)
    assert time.monotonic() - t0 < 1.0  # the end of the stream, not the 1.5 s timeout
    assert lost == [m] and "the node link closed" in str(m.lost)
    assert leader.lost() == [] and leader.live() == []  # told once


def test_the_leader_gives_a_slot_to_the_node_of_that_rank_first_else_to_a_spare(
        leader: LeaderLink) -> None:
    # a job of 4 nodes: nodes 1-3 of ranks, node 4 a spare node
    spare = FollowerLink("127.0.0.1", leader.port, 4, timeout_s=5.0)
    one = FollowerLink("127.0.0.1", leader.port, 1, timeout_s=5.0)
    three = FollowerLink("127.0.0.1", leader.port, 3, timeout_s=5.0)
    until(lambda: len(leader.live()) == 3)
    assert leader.take(2, exact=True, spare_from=4) is None  # at the start only node 2
    m = leader.take(1, exact=True, spare_from=4)
    assert m is not None and (m.node_rank, m.slot) == (1, 1)
    assert leader.take(1, exact=True, spare_from=4) is None  # held now
    # slot 2 lost (say): the spare node takes it, never node 3, which waits for its own
    s = leader.take(2, exact=False, spare_from=4)
    assert s is not None and (s.node_rank, s.slot) == (4, 2)
    assert leader.take(0, exact=False, spare_from=4) is None
    t = leader.take(3, exact=True, spare_from=4)
    assert t is not None and (t.node_rank, t.slot) == (3, 3)
    for link in (spare, one, three):
        link.close()


def test_a_node_started_again_is_told_so_and_names_its_spares_anew(
        leader: LeaderLink) -> None:
    first = FollowerLink("127.0.0.1", leader.port, 1, timeout_s=5.0)
    assert first.again == 0
    until(lambda: leader.live())
    first.close()
    until(lambda: leader.lost())
    second = FollowerLink("127.0.0.1", leader.port, 1, timeout_s=5.0)
    assert second.again == 1  # (its warm spares: 1r1-0, ..., not the first start's 1-0)
    second.close()


def test_a_silent_node_is_lost_after_the_timeout(leader: LeaderLink) -> None:
    raw = socket.create_connection(("127.0.0.1", leader.port))
    raw.sendall(json.dumps({"node_rank": 2}).encode() + b"\n")
    assert json.loads(raw.makefile().readline()) == {"ok": True, "again": 0}
    until(lambda: leader.live())
    t0 = time.monotonic()
    lost: list[Member] = []
    until(lambda: lost.extend(leader.lost()) or lost, timeout=10.0)
    assert 1.4 < time.monotonic() - t0 < 5.0
    assert lost[0].node_rank == 2 and "silent for" in str(lost[0].lost)
    raw.close()


@pytest.mark.parametrize("hello", [b"GET / HTTP/1.1\r\n\r\n", b'{"node_rank": 0}\n',
                                   b'{"node_rank": "1"}\n', b'{"rank": 1}\n', b"[1]\n",
                                   b"x" * 5000])
def test_what_is_not_a_followers_hello_is_closed_and_joins_nothing(
        leader: LeaderLink, hello: bytes) -> None:
    raw = socket.create_connection(("127.0.0.1", leader.port), timeout=5)
    with contextlib.suppress(OSError):  # (closed while sending the long one)
        raw.sendall(hello)
    assert closed(raw)  # no answer: the leader closed it
    raw.close()
    assert leader.live() == []


def closed(raw: socket.socket) -> bool:
    """Whether the peer closed the connection without a word (a reset is a close too)."""
    try:
        return raw.recv(100) == b""
    except ConnectionResetError:
        return True


def test_two_nodes_of_one_rank_the_second_is_refused_with_why(leader: LeaderLink) -> None:
    first = FollowerLink("127.0.0.1", leader.port, 1, timeout_s=5.0)
    until(lambda: leader.live())
    with pytest.raises(ConnectionError, match=r"node 1 is already in the job, at 127\.0\.0\.1"):
        FollowerLink("127.0.0.1", leader.port, 1, timeout_s=5.0)
    assert len(leader.live()) == 1
    first.close()


def test_a_follower_knows_at_once_that_the_leader_is_gone(leader: LeaderLink) -> None:
    follower = FollowerLink("127.0.0.1", leader.port, 1, timeout_s=5.0)
    until(lambda: leader.live())
    leader.close()
    until(lambda: follower.gone, timeout=2.0)
    assert "leader (node 0)" in str(follower.gone)
    follower.close()


@pytest.mark.parametrize(("args", "said"), [
    ((2, -1, "h", 1), "--node-rank must be 0 or more"),
    ((0, 0, "h", 1), "--nnodes must be 1 or more"),
    ((2, 1, "h", 70000), "--master-port must be a TCP port"),
])
def test_a_node_spec_says_what_is_wrong(args: tuple[int, int, str, int], said: str) -> None:
    with pytest.raises(ValueError, match=said):
        NodeSpec(*args)


def test_a_spare_node_is_a_node_rank_past_the_jobs_nodes() -> None:
    assert NodeSpec(2, 0, "h", 29500).leads and not NodeSpec(2, 1, "h", 29500).spare
    assert NodeSpec(2, 2, "h", 29500).spare and not NodeSpec(2, 2, "h", 29500).leads


@pytest.mark.parametrize(("args", "said"), [
    (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--", "python", "x.py"],
     "--nnodes 2: give --master-addr"),
    (["--nnodes", "2", "--master-addr", "h", "--", "python", "x.py"],
     "--nnodes, --node-rank and --master-addr take --nproc-per-node"),
    (["--nproc-per-node", "2", "--nnodes", "2", "--master-addr", "h", "--", "python", "x.py"],
     "--nnodes 2: give each node its --node-rank (0 on the node at --master-addr"),
])
def test_ciuic_run_refuses_a_job_of_several_nodes_it_cannot_start(args: list[str],
                                                                   said: str) -> None:
    run = subprocess.run([*CIUIC, "run", *args], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and said in run.stderr, run.stderr
