"""How long torch's c10d rendezvous keeps a lost node's slot, by its keep-alive settings, and
what an agent that stalls (a GC pause, a loaded machine) does to a running job.

    .venv/bin/python bench/studies/recovery_nodes_keepalive.py [--rounds 3] [--stall 3]
        [--json FILE]   # default: bench/results/recovery_nodes_keepalive-<date>.json

Root only: 2 simulated nodes (network namespaces on a bridge, tests/netns.py), plain torchrun
on each (``--nnodes 2 --nproc-per-node 1``, c10d on node 1, ``--max-restarts 20``), a worker
that only all-reduces a scalar every 0.1 s (so that what is measured is the rendezvous, not
a restore). For each ``--rdzv-conf keep_alive_interval=I,keep_alive_max_attempt=A`` (torch's
default 5 x 3 first), interleaved round by round:

- ``lost``: node 2 SIGKILLed whole (agent and worker) and started again at once; timed from
  the kill to the process group of the next generation on both nodes (the later of the two
  workers' ``init_process_group`` returning; one clock for every netns);
- ``stall``: node 2's agent stopped (SIGSTOP) for ``--stall`` seconds and continued, its worker
  running on: whether the job restarted its workers within 15 s after (a false loss), and, for
  a stall longer than I x A, what it costs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.recovery import summary  # noqa: E402
from bench.recovery_nodes import fresh, load, machine  # noqa: E402
from tests.netns import Nodes  # noqa: E402

WORKER = """
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"rank": dist.get_rank(), "t": time.time(), "pid": os.getpid(),
                        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))})
            + "\\n")
t = torch.zeros(1)
while True:
    dist.all_reduce(t)
    time.sleep(0.1)
"""
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONWARNINGS": "ignore", "LOGLEVEL": "INFO"}
CONFS = ((5, 3), (2, 3), (1, 5), (1, 3))


class Pair:
    """The 2-node job with one keep-alive setting (None: torch's defaults, nothing passed)."""

    def __init__(self, nodes: Nodes, folder: Path, conf: tuple[int, int] | None, n: int
                 ) -> None:
        self.nodes, self.folder, self.conf = nodes, folder, conf
        self.times = folder / f"times-{n}.jsonl"
        self.rdzv = f"ka{nodes.id}x{n}"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, i: int) -> None:
        node = self.nodes[i]
        conf = f"is_host={int(i == 1)}"
        if self.conf is not None:
            conf += f",keep_alive_interval={self.conf[0]},keep_alive_max_attempt={self.conf[1]}"
        with open(self.folder / f"node{i}.log", "ab") as log:
            self.procs[i] = node.popen([
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{self.nodes[1].addr}:29400", "--rdzv-id", self.rdzv,
                "--local-addr", node.addr, "--max-restarts", "20", "--rdzv-conf", conf,
                "--monitor-interval", "0.2", str(self.folder / "worker.py"), str(self.times)],
                stdout=log, stderr=subprocess.STDOUT, env={**node.env, **ENV}, cwd=ROOT)

    def records(self) -> list[dict[str, Any]]:
        if not self.times.exists():
            return []
        return [json.loads(x) for x in self.times.read_text().splitlines() if x.strip()]

    def wait_records(self, count: int, timeout: float) -> list[dict[str, Any]]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = self.records()
            if len(got) >= count:
                return got
            time.sleep(0.05)
        raise TimeoutError(f"{count} worker starts did not come within {timeout} s")

    def stop(self) -> None:
        for node in self.nodes:
            node.kill_all()


def lost(pair: Pair) -> dict[str, Any]:
    pair.start(1)
    pair.start(2)
    pair.wait_records(2, 120)
    time.sleep(3.0)  # a running job: the heartbeats in their steady state
    t0 = time.time()
    pair.nodes[2].kill_all()
    pair.start(2)
    rows = pair.wait_records(4, 120)[2:]
    pair.stop()
    return {"total_s": max(r["t"] for r in rows) - t0, "load": load()}


def stall(pair: Pair, seconds: float) -> dict[str, Any]:
    pair.start(1)
    pair.start(2)
    pair.wait_records(2, 120)
    time.sleep(3.0)
    agent = pair.procs[2].pid
    os.kill(agent, signal.SIGSTOP)
    time.sleep(seconds)
    os.kill(agent, signal.SIGCONT)
    time.sleep(15.0)
    restarted = len(pair.records()) > 2
    pair.stop()
    return {"stall_s": seconds, "restarted": restarted, "load": load()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stall", type=float, nargs="*", default=[3.0, 8.0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/ciuic-keepalive"))
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" /
                   f"recovery_nodes_keepalive-{time.strftime('%F')}.json")
    a = p.parse_args()
    fresh(a.dir)
    (a.dir / "worker.py").write_text(WORKER)
    meta: dict[str, Any] = {"machine": machine(), "when": time.strftime("%F %T %Z"),
                            "load_at_start": load(), "rounds": a.rounds}
    print(f"machine: {meta['machine']}; load {meta['load_at_start']}", flush=True)
    rows: list[dict[str, Any]] = []
    nodes = Nodes(2)
    n = 0
    try:
        nodes.make(2)
        for r in range(a.rounds):
            for conf in CONFS:
                n += 1
                row = {"round": r + 1, "conf": list(conf), "mode": "lost",
                       **lost(Pair(nodes, a.dir, None if conf == (5, 3) else conf, n))}
                rows.append(row)
                print(f"round {r + 1} {conf}: lost node, {row['total_s']:.2f} s to the next "
                      f"process group; load {row['load']['loadavg_1m']}", flush=True)
        for seconds in a.stall:
            for conf in CONFS:
                n += 1
                row = {"conf": list(conf), "mode": "stall",
                       **stall(Pair(nodes, a.dir, None if conf == (5, 3) else conf, n),
                               seconds)}
                rows.append(row)
                print(f"{conf}: agent stalled {seconds:g} s: "
                      f"{'the workers restarted' if row['restarted'] else 'no restart'}; "
                      f"load {row['load']['loadavg_1m']}", flush=True)
    finally:
        nodes.close()
    meta |= {"load_at_end": load()}
    out = {**meta, "lost": {f"{c[0]}x{c[1]}": summary([r["total_s"] for r in rows
                                                        if r["mode"] == "lost"
                                                        and tuple(r["conf"]) == c])
                            for c in CONFS}, "rows": rows}
    for conf, s in out["lost"].items():
        print(f"keep_alive {conf}: kill -> next process group {s['min']:.2f} / "
              f"{s['median']:.2f} / {s['max']:.2f} s")
    a.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
