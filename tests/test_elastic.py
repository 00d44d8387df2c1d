"""Elastic restart on fewer nodes (issue #45, item 3), on simulated nodes (network namespaces;
root): a node lost with no replacement, the job goes on with the nodes that remain
(``torchrun --nnodes MIN:MAX`` under ``ciuic run``), resharding its snapshot from the
survivors' memory and the lost node's replica in a peer's memory, and splitting the rest of
the epoch between the ranks that remain."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ciuic.chain.repo import Repository
from tests import netns
from tests.netns import Node, Nodes
from tests.test_multinode import (
    HELPER,
    assert_same,
    committed_step,
    count,
    mib,
    wait_for,
)

pytestmark = pytest.mark.slow
netns_nodes = netns.netns_nodes  # the fixture, for this module's tests

DATA = 240  # samples: 10 steps an epoch on 6 ranks (batches of 4), 15 on 4


def elastic(node: Node, nodes: Nodes, tmp: Path, rdzv: str, *args: str
            ) -> subprocess.Popen[bytes]:
    """Node ``node``'s ``ciuic run`` around its torchrun of 2 ranks, in a job of 2 to 3 such
    nodes (``--nnodes 2:3``: a round completes at once with 3, or with 2 once the last call
    has passed), output to ``tmp/n<i>.log``."""
    with open(tmp / f"n{node.index}.log", "ab") as log:
        return node.popen([
            sys.executable, "-m", "ciuic", "run", "--", sys.executable, "-m",
            "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes[1].addr}:29400",
            "--rdzv-id", rdzv, "--local-addr", node.addr, "--max-restarts", "3",
            "--rdzv-conf", f"is_host={int(node.index == 1)},last_call_timeout=5",
            "--monitor-interval", "0.2", str(HELPER), *args],
            stdout=log, stderr=subprocess.STDOUT, env={**node.env, "PYTHONWARNINGS": "ignore",
                                                       "CIUIC_RUN_LOG": "debug"})


def epochs_seen(out: Path, restored: int) -> dict[int, Counter[int]]:
    """The indices the job trained on, by epoch (each step's batch, every rank's): the 6 ranks'
    steps up to the restored snapshot, then the 4 ranks' (the steps between the snapshot and
    the loss were rolled back)."""
    trained: dict[int, list[tuple[int, list[int]]]] = {}  # step -> each rank's batch
    for world, upto in ((6, restored), (4, None)):
        files = sorted(out.glob(f"seen-w{world}-*.json"))
        assert len(files) == world, files  # one start of the workers on each number of ranks
        for f in files:
            got = json.loads(f.read_text())
            for step, batch in got["seen"].items():
                if upto is None or int(step) <= upto:
                    trained.setdefault(int(step), []).append((got["world"], batch))
    by_epoch: dict[int, Counter[int]] = {}
    done, epoch = 0, 0
    for step in sorted(trained):
        batches = trained[step]
        assert len(batches) == batches[0][0], (step, len(batches))  # every rank of the step
        for _, batch in batches:
            by_epoch.setdefault(epoch, Counter()).update(batch)
        done += sum(len(b) for _, b in batches)
        if done >= DATA:
            done, epoch = done - DATA, epoch + 1
    return by_epoch


def test_a_lost_node_with_no_replacement_the_job_goes_on_with_the_nodes_left(
        netns_nodes: Callable[[int], Nodes], tmp_path: Path) -> None:
    """3 nodes x 2 ranks, FSDP2. Node 3 is SIGKILLed, all of it, after its replica of the
    snapshot at step 5 reached node 1, and nothing replaces it: the two nodes left form a job
    of 4 ranks (torchrun's rendezvous, once the lost node's keep-alive lapsed), restore the
    6-rank snapshot onto 4 ranks, every tensor equal to the snapshot's, reading node 3's
    shards from node 1's memory and nothing from the store, split the rest of the epoch
    between the 4 ranks (no sample trained twice or skipped), and finish the job."""
    nodes = netns_nodes(3)
    out, store = tmp_path / "out", tmp_path / "store"
    job = ["--store", str(store), "--out", str(out), "--steps", "30", "--every", "5",
           "--hidden", "64", "--model", "fsdp2", "--data", str(DATA), "--dump",
           "--pause-at", f"7:4:{tmp_path / 'paused'}"]  # rank 4 (node 3) waits at step 7
    procs = {n.index: elastic(n, nodes, tmp_path, f"el{nodes.id}", *job) for n in nodes}
    wait_for(lambda: count(tmp_path / "n3.log",
                           r"holds a replica of this node's snapshot at step 5 ") >= 1,
             240, "node 3's replica of the snapshot at step 5")
    wait_for(lambda: (tmp_path / "paused").exists(), 120, "rank 4's pause at step 7")
    assert committed_step(store) == 5
    killed = time.monotonic()
    nodes[3].kill_all()
    resumed = r"Resuming training at step 6 on 4 ranks \(the snapshot was taken on 6\)"
    back = wait_for(lambda: count(tmp_path / "n1.log", resumed) + count(tmp_path / "n2.log",
                                                                        resumed), 240,
                    "the job to resume on 4 ranks")
    print(f"from node 3's loss to the job resumed on 2 nodes: {back - killed:.1f} s")
    codes = [procs[i].wait(400) for i in (1, 2)]
    text, text2 = ((tmp_path / f"n{i}.log").read_text(errors="replace") for i in (1, 2))
    assert codes == [0, 0], (text[-4000:], text2[-4000:])
    both = text + text2
    # ciuic run said at the start what a loss with no replacement does and costs
    assert "ciuic run: the job runs on 2 to 3 nodes: a node lost with none to replace it" in text
    with Repository.open(store) as repo:
        last = repo.catalog.latest("sup", "default")
        assert last is not None and (last.step, last.world_size) == (29, 4)
    # the 6-rank snapshot, restored onto 4 ranks: every tensor the snapshot's
    assert_same(load_file(str(out / "restored-5-w4.safetensors")),
                load_file(str(out / "at-5-w6.safetensors")))
    # from memory: node 3's shards from the replica in node 1's memory
    read = re.search(r"Read (.+) from host memory, (.+) from other nodes' memory and (.+) from "
                     r"the store in [\d.]+ s \(all 4 ranks\)", both)
    assert read, both[-4000:]
    assert read.group(3) == "0 B" and mib(read.group(2)) > 0, read.group(0)
    # the data: every sample of each epoch exactly once (240 divides among 6 and 4 ranks'
    # batches of 4 at this step: no padding), whatever the number of ranks that trained it
    seen = epochs_seen(out, 5)
    assert set(seen) == {0, 1, 2}, sorted(seen)
    for epoch in (0, 1):
        assert seen[epoch] == Counter(range(DATA)), (epoch, seen[epoch].most_common(3))
    final = load_file(str(out / "final-ciuic.safetensors"))
    assert final and all(t.isfinite().all() for t in final.values())
