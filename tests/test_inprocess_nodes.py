"""In-process recovery across nodes (#46), on simulated nodes (tests/netns.py; root only,
skipped with the reason elsewhere): ``ciuic run --nproc-per-node 2 --nnodes 2`` on each of two
nodes (node 0 leads), a third started as a spare node, 4 DDP ranks of tests/helpers/ip_train.py.

- A node lost, all of it (every process SIGKILLed): the leader hears its node link close, the
  two ranks of the other node stay in their processes, the spare node's warm spares take the
  lost ranks, restoring them from the replica the leader's node holds in memory, and the job
  ends with every tensor equal to an uninterrupted run's.
- A rank killed on a node that does not lead: that node replaces it, the other three stay.
- The leader lost: the other node ends its ranks and says what to do (no control store, no
  in-process recovery).

How long each recovery took, from the fault to every rank's next step, is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests import netns
from tests.netns import Node, Nodes
from tests.test_inprocess import launch as launch_one_node
from tests.test_multinode import mib, recovered_from, wait_for
from tests.test_supervisor import assert_same, final

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="ciuic run needs Linux")]
netns_nodes = netns.netns_nodes  # the fixture, for this module's tests

HELPER = Path(__file__).parent / "helpers" / "ip_train.py"
JOB = ["--steps", "60", "--every", "5", "--step-sleep", "0.1"]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """Each model's job run through without a fault, when first asked for: 4 ranks on one node
    (the ranks' data and model depend on the global rank only)."""

    class Lazy(dict[str, dict[str, torch.Tensor]]):
        def __missing__(self, model: str) -> dict[str, torch.Tensor]:
            out = tmp_path_factory.mktemp(f"ref-{model}")
            run = launch_one_node(out, *JOB, model=model)
            assert run.returncode == 0, run.stderr[-4000:]
            self[model] = final(out / "out")
            return self[model]

    return Lazy()


@pytest.fixture
def uninterrupted(references: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return references["ddp"]


def start(node: Node, nodes: Nodes, tmp: Path, node_rank: int, *args: str,
          run_args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    """Node ``node``'s ``ciuic run`` as node ``node_rank`` of the job (2 or more: a spare
    node), its output in ``tmp/n<index>.log``."""
    with open(tmp / f"n{node.index}.log", "ab") as log:
        return node.popen([
            sys.executable, "-m", "ciuic", "run", "--nproc-per-node", "2", "--nnodes", "2",
            "--node-rank", str(node_rank), "--master-addr", nodes[1].addr, "--master-port",
            "29500", "--peer-timeout", "5", *run_args, "--", sys.executable, str(HELPER),
            "--store", str(tmp / "store"), "--out", str(tmp / "out"), *JOB, *args],
            # each replica sent is said at DEBUG after the first (a test waits for a step's)
            stdout=log, stderr=subprocess.STDOUT,
            env={**node.env, "PYTHONWARNINGS": "ignore", "CIUIC_RUN_LOG": "debug"})


def step_of(out: Path, rank: int) -> int:
    """The last step rank ``rank`` finished (-1: none yet)."""
    path = out / f"steps-{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else -1


def recovery_s(out: Path, since: float) -> float:
    """From ``since`` (the fault) to the last rank's first step after it."""
    firsts = []
    for r in range(4):
        rows = [json.loads(x) for x in (out / f"steps-{r}.jsonl").read_text().splitlines()]
        firsts.append(min(x["time"] for x in rows if x["time"] > since))
    return max(firsts) - since


def text(tmp: Path, index: int) -> str:
    return (tmp / f"n{index}.log").read_text(errors="replace")


def test_a_lost_node_goes_to_a_spare_node_whose_ranks_restore_from_a_peers_memory(
        netns_nodes: Callable[[int], Nodes], tmp_path: Path,
        uninterrupted: dict[str, torch.Tensor]) -> None:
    nodes = netns_nodes(3)
    slow = ("--step-sleep", "0.3")  # a snapshot every 1.5 s: the kill comes before the next
    leader = start(nodes[1], nodes, tmp_path, 0, *slow)
    lost = start(nodes[2], nodes, tmp_path, 1, *slow)
    spare = start(nodes[3], nodes, tmp_path, 2, *slow, run_args=("--spares", "2"))
    out = tmp_path / "out"
    # killed once node 0 holds the replica of node 1's snapshot at step 15 (the replicas are
    # sent after each commit, in the background)
    wait_for(lambda: "holds a replica of this node's snapshot at step 15 " in text(tmp_path, 2)
             or leader.poll() is not None, 180, "node 1's replica of step 15 on node 0")
    killed = time.time()
    assert nodes[2].kill_all(), "node 1 ran nothing"
    assert leader.wait(180) == 0, text(tmp_path, 1)[-5000:]
    assert spare.wait(60) == 0, text(tmp_path, 3)[-5000:]
    assert lost.wait(10) == -9
    said = text(tmp_path, 1)
    assert f"node 1 ({nodes[2].addr}) lost: its ciuic run exited or the node went down" in said
    assert "Generation 1: 2 ranks stay in their processes; node 1's ranks (ranks 2-3) go to " \
           "the next node to join" in said, said[-4000:]
    assert f"node 2 ({nodes[3].addr}) takes node 1's place (ranks 2-3) in generation 1" in said
    assert "rank 2 goes to warm spare 2-0, rank 3 goes to warm spare 2-1" in text(tmp_path, 3)
    # node 1's chunks came from the replica node 0 held in memory, none from the store
    assert "Resuming training at step 16" in said, said[-3000:]
    _, peers, store = recovered_from(said)
    assert mib(peers) > 0 and mib(store) == 0, said[-3000:]
    assert_same(final(out), uninterrupted)
    print(f"a node lost, a spare node ready: {recovery_s(out, killed):.2f} s from the kill to "
          "every rank's next step")


@pytest.mark.parametrize(("model", "fault"), [
    ("ddp", "12:3:backward:kill"),
    # FSDP2's reduce-scatter: (CI's hour; the same path as DDP's)
    pytest.param("fsdp2", "12:3:allreduce:kill", marks=pytest.mark.long)])
def test_a_rank_killed_on_a_node_that_follows_is_replaced_there(
        netns_nodes: Callable[[int], Nodes], tmp_path: Path,
        references: dict[str, dict[str, torch.Tensor]], model: str, fault: str) -> None:
    nodes = netns_nodes(2)
    args = ("--model", model, "--fault", fault)
    procs = [start(nodes[1], nodes, tmp_path, 0, *args),
             start(nodes[2], nodes, tmp_path, 1, *args)]
    assert [p.wait(180) for p in procs] == [0, 0], text(tmp_path, 1)[-5000:]
    said, there = text(tmp_path, 1), text(tmp_path, 2)
    assert "rank 3 (pid " in said and ", node 1): signal: SIGKILL (killed) at step 11" in said
    assert "Generation 1: 3 ranks stay in their processes" in said, said[-4000:]
    assert "generation 1 (rank 3 " in there and "1 rank stays in its process; rank 3 starts " \
           "anew" in there, there[-4000:]
    assert_same(final(tmp_path / "out"), references[model])
    fault_at = json.loads((tmp_path / "out" / "fault-12-3.json").read_text())["time"]
    print(f"a rank killed on node 1 ({model}): {recovery_s(tmp_path / 'out', fault_at):.2f} s "
          "from the kill to every rank's next step")


@pytest.mark.long  # (CI's hour: an error path, about 20 s)
def test_the_leaders_loss_ends_the_other_nodes_ranks_and_says_what_to_do(
        netns_nodes: Callable[[int], Nodes], tmp_path: Path) -> None:
    nodes = netns_nodes(2)
    leader = start(nodes[1], nodes, tmp_path, 0)
    other = start(nodes[2], nodes, tmp_path, 1)
    wait_for(lambda: step_of(tmp_path / "out", 2) >= 8 or other.poll() is not None, 180,
             "rank 2 to pass step 8")
    assert nodes[1].kill_all()
    assert other.wait(60) == 1, text(tmp_path, 2)[-4000:]
    said = text(tmp_path, 2)
    assert "In-process recovery cannot go on without node 0" in said, said[-4000:]
    assert "Start the job again (on every node) and it resumes from its last snapshot" in said
    wait_for(lambda: not nodes[2].pids(), 30, "node 1 to be empty")
    assert leader.wait(10) == -9


@pytest.mark.long  # (CI's hour: the node link's timeout; the kill of a node covers the rest)
def test_a_node_cut_off_goes_to_the_spare_node_and_its_own_ranks_end_when_it_comes_back(
        netns_nodes: Callable[[int], Nodes], tmp_path: Path,
        uninterrupted: dict[str, torch.Tensor]) -> None:
    nodes = netns_nodes(3)
    leader = start(nodes[1], nodes, tmp_path, 0)
    cut = start(nodes[2], nodes, tmp_path, 1)
    spare = start(nodes[3], nodes, tmp_path, 2, run_args=("--spares", "2"))
    out = tmp_path / "out"
    wait_for(lambda: step_of(out, 2) >= 18 or leader.poll() is not None, 180,
             "rank 2 (node 1) to pass step 18")
    nodes[2].link(False)  # a cable pulled: nothing closes, node 1 falls silent
    wait_for(lambda: "node 1 (" in text(tmp_path, 1) and ") lost: silent for" in
             text(tmp_path, 1), 60, "the leader to lose node 1")
    nodes[2].link(True)  # back: its ranks must not rejoin the job, whose ranks 2-3 moved
    assert leader.wait(180) == 0, text(tmp_path, 1)[-5000:]
    assert spare.wait(60) == 0, text(tmp_path, 3)[-5000:]
    assert cut.wait(60) == 1, text(tmp_path, 2)[-4000:]
    said = text(tmp_path, 2)
    # (the node ends its ranks on the leader's silence, or, back first, on seeing its ranks
    # given to node 2; a rank that saw it first ends by itself)
    assert ("In-process recovery cannot go on without node 0" in said
            or "its ranks now: ending this node's ranks" in said), said[-4000:]
    assert "2 ranks stay in their processes" not in said, said[-4000:]
    assert f"node 2 ({nodes[3].addr}) takes node 1's place (ranks 2-3)" in text(tmp_path, 1)
    wait_for(lambda: not nodes[2].pids(), 30, "node 1 to be empty")
    assert_same(final(out), uninterrupted)
