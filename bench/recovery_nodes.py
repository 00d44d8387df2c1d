"""Recovery of a multi-node job: the time from a fault to the first resumed ``step()`` of every
rank, for a DDP job on 2 simulated nodes x 2 ranks (gloo), each node under ``ciuic run``
(``ciuic run -- python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 ...``).

    .venv/bin/python bench/recovery_nodes.py [--rounds 3] [--gib 1.0]
        [--json FILE]     # default: bench/results/recovery_nodes-<date>.json

Root only: the nodes are network namespaces on a bridge (tests/netns.py). The job
(bench/recovery_nodes_worker.py) trains a model with bench/run.py's reference shapes plus Adam
(about ``--gib`` GiB; every step changes every parameter) and snapshots every ``--every`` steps.
One job runs through all rounds; each round makes three faults, the first two in alternating
order, each once the latest snapshot is committed and both nodes' replicas of it are complete
(the line "node N ... holds a replica of this node's snapshot at step S" in each node's
``ciuic run`` output):

- ``local``: rank 3 (node 2) SIGKILLed; torchrun restarts every worker of both nodes, and each
  restores from its own node's memory (its ranks' copies and the other node's replica);
- ``peer``: node 2 SIGKILLed whole (``ciuic run``, torchrun, workers) and started again at once
  with empty memory: its ranks read from node 1's memory;
- ``store``: both nodes SIGKILLed whole, the store's files dropped from the page cache (fsync
  and ``POSIX_FADV_DONTNEED``, as bench/recovery.py), both started again. The clock starts
  after the eviction (the time it took is added to the kill's).

Each fault is timed from the kill to the first ``step()`` returned on every rank (the max over
ranks; the worker's ``time.time()``, one clock for every netns) and split at the latest rank's
interpreter start (detection, rendezvous, process start), its process group, its model, DDP and
manager built, ``restore()`` returned, and its first step (one training step and
``manager.step``). Rank 0's log line "Read X from host memory, Y from other nodes' memory and Z
from the store in T s (all 4 ranks)" gives the bytes from each source and ciuic's own restore
time. Interleaved round by round; min / median / max; raw rows in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.recovery import summary  # noqa: E402
from tests.netns import Nodes, remove_leftovers, unavailable  # noqa: E402

WORKER = Path(__file__).with_name("recovery_nodes_worker.py")
# torch 2.13's agents share the rendezvous TCPStore with the workers by default; then a node
# started again waits for a MASTER_ADDR that is published only at the first rendezvous
# (tests/test_multinode.py, SHARED_STORE_OFF); ciuic run sets it too (cli/run.torchrun_env).
# CIUIC_RUN_LOG=debug: every replica sent is logged (at INFO only the first and the changes).
ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONWARNINGS": "ignore", "LOGLEVEL": "INFO",
       "CIUIC_RUN_LOG": "debug"}
REPLICA = re.compile(r"node (\d+) \(\S+\) holds a replica of this node's snapshot at step (\d+) "
                     r"\((\d+) new chunks, ([\d.]+) MiB sent in ([\d.]+) s\)")
READ = re.compile(r"Read (.+?) from host memory, (.+?) from other nodes' memory and (.+?) from "
                  r"the store in ([\d.]+) s \(all (\d+) ranks\)")
HELD = re.compile(r"ciuic run holds (\S+ \S+) on this node")
RDZV = re.compile(r"^I(\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) .*Rendezvous complete for workers",
                  re.M)
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
MODES = ("local", "peer", "store")
PHASES = ("to_start_s", "init_s", "build_s", "restore_s", "first_step_s")


def size(text: str) -> int:
    """Bytes of a ciuic size ("0 B", "1.06 GiB")."""
    n, unit = text.split()
    return round(float(n) * UNITS[unit])


def machine() -> dict[str, Any]:
    mem = Path("/proc/meminfo").read_text().split("\n")[0].split()[1]
    return {"nproc": os.cpu_count(), "ram_gib": round(int(mem) / 2**20, 1),
            "kernel": platform.release(), "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": __import__("torch").__version__}


def ciuic_source() -> dict[str, Any]:
    """Where the measured ciuic comes from: its package and the repository's commit and
    whether src/ differs from it (PYTHONPATH may point at a clean export of a commit)."""
    import ciuic

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT
                              ).stdout.strip()
    return {"package": str(Path(ciuic.__file__).parent), "head": git("rev-parse", "HEAD"),
            "src_dirty_in_checkout": bool(git("status", "--porcelain", "--", "src"))}


def load() -> dict[str, Any]:
    """The machine's load now: other work shares the 2 cores and the memory."""
    avail = next(x for x in Path("/proc/meminfo").read_text().splitlines()
                 if x.startswith("MemAvailable"))
    return {"loadavg_1m": float(Path("/proc/loadavg").read_text().split()[0]),
            "mem_available_gib": round(int(avail.split()[1]) / 2**20, 1)}


def evict(folder: Path) -> None:
    """Write back and drop every file of the store from the page cache (fsync each file, then
    ``POSIX_FADV_DONTNEED``; bench/recovery_worker.py does the same with a global sync)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def fresh(folder: Path) -> None:
    """Before a run: exit where simulated nodes cannot be made, remove what a crashed run left
    (its netns, its bridge), and empty ``folder``."""
    why = unavailable()
    if why:
        sys.exit(why)
    remove_leftovers()
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


def wait_for(what: Any, timeout: float, why: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout} s waiting for {why}")


class Job:
    """The 2 x 2 job on ``nodes``: its processes, its logs (appended across starts), its
    times file and its faults."""

    def __init__(self, nodes: Nodes, folder: Path, gib: float, every: int,
                 step_sleep: float, timeout: float) -> None:
        self.nodes, self.folder, self.timeout = nodes, folder, timeout
        self.ciuic_run = [sys.executable, "-m", "ciuic", "run"]
        self.store, self.times = folder / "store", folder / "times.jsonl"
        self.args = ["--store", str(self.store), "--times", str(self.times), "--gib", str(gib),
                     "--every", str(every), "--step-sleep", str(step_sleep)]
        self.logs = {n.index: folder / f"node{n.index}.log" for n in nodes}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.since = {i: 0 for i in self.logs}  # log offsets of the latest fault
        self.restored: int | None = None

    def start(self, i: int) -> None:
        node, first = self.nodes[i], self.nodes[1]
        with open(self.logs[i], "ab") as log:
            self.procs[i] = node.popen([
                *self.ciuic_run, "--", sys.executable, "-m",
                "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{first.addr}:29400",
                "--rdzv-id", f"bench{self.nodes.id}", "--local-addr", node.addr,
                "--max-restarts", "20", "--rdzv-conf", f"is_host={int(i == 1)}",
                "--monitor-interval", "0.2", str(WORKER), *self.args],
                stdout=log, stderr=subprocess.STDOUT, env={**node.env, **ENV}, cwd=ROOT)

    def kill_node(self, i: int) -> None:
        self.nodes[i].kill_all()
        self.procs[i].wait(30)

    def text(self, i: int) -> str:
        with open(self.logs[i], "rb") as f:
            f.seek(self.since[i])
            return f.read().decode(errors="replace")

    def records(self) -> list[dict[str, Any]]:
        if not self.times.exists():
            return []
        return [json.loads(x) for x in self.times.read_text().splitlines() if x.strip()]

    def ready(self) -> tuple[int, dict[int, list[float]]]:
        """Wait for a snapshot newer than the latest restored one whose replicas both nodes
        report complete; its step and each node's push (MiB sent, seconds)."""
        def common() -> tuple[int, dict[int, list[float]]] | None:
            seen = [{int(m[2]): [float(m[4]), float(m[5])] for m in REPLICA.finditer(
                self.text(i)) if self.restored is None or int(m[2]) > self.restored}
                for i in (1, 2)]
            steps = set(seen[0]) & set(seen[1])
            if not steps:
                self.check_alive()
                return None
            s = max(steps)
            return s, {1: seen[0][s], 2: seen[1][s]}
        try:
            got: tuple[int, dict[int, list[float]]] = wait_for(
                common, self.timeout, f"both replicas of a snapshot after step {self.restored}")
        except TimeoutError as e:
            failed = [x for i in (1, 2) for x in self.text(i).splitlines() if "not sent" in x]
            raise TimeoutError(f"{e}; the last failed pushes:\n"
                               + "\n".join(failed[-4:])) from None
        return got

    def check_alive(self) -> None:
        for i, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"node {i}'s ciuic run exited {proc.returncode}:\n"
                                   + self.logs[i].read_text(errors="replace")[-4000:])

    def fault(self, mode: str) -> dict[str, Any]:
        step, pushes = self.ready()
        before = len(self.records())
        since = {i: self.logs[i].stat().st_size for i in self.logs}
        row: dict[str, Any] = {"mode": mode, "snapshot": step, "load": load(),
                               "replica_push_mib_s": pushes}
        if mode == "local":
            rank3 = [r for r in self.records() if r["rank"] == 3][-1]
            t0 = time.time()
            os.kill(rank3["pid"], signal.SIGKILL)
        elif mode == "peer":
            t0 = time.time()
            self.kill_node(2)
            self.start(2)
        else:
            t_kill = time.time()
            self.kill_node(1)
            self.kill_node(2)
            t_evict = time.time()
            evict(self.store)
            row["evict_s"] = time.time() - t_evict
            t0 = t_kill + row["evict_s"]
            self.start(1)
            self.start(2)
        self.since = since
        def resumed() -> list[dict[str, Any]] | None:
            self.check_alive()
            new = self.records()[before:]
            return new if len(new) >= 4 else None

        rows = wait_for(resumed, self.timeout, f"4 ranks resumed ({mode})")
        ranks = {r["rank"]: r for r in rows}
        assert sorted(ranks) == [0, 1, 2, 3], rows
        restored = {r["restored"] for r in rows}
        row["restored"] = sorted(restored)
        if restored != {step}:
            print(f"  note: restored {sorted(restored)}, the snapshot waited for was {step}",
                  flush=True)
        self.restored = max(restored)
        latest = {k: max(r[k] for r in rows) for k in
                  ("start", "pg", "built", "restored_at", "first_step")}
        row |= {"total_s": latest["first_step"] - t0, "to_start_s": latest["start"] - t0,
                "init_s": latest["pg"] - latest["start"],
                "build_s": latest["built"] - latest["pg"],
                "restore_s": latest["restored_at"] - latest["built"],
                "first_step_s": latest["first_step"] - latest["restored_at"],
                "to_restored_s": latest["restored_at"] - t0,
                "ranks": [{k: (v - t0 if k in latest else v) for k, v in ranks[r].items()}
                          for r in sorted(ranks)]}
        read = wait_for(lambda: READ.search(self.text(1)) or READ.search(self.text(2)), 30,
                        "rank 0's 'Read ... from the store' line")
        row |= {"from_memory_b": size(read[1]), "from_peers_b": size(read[2]),
                "from_store_b": size(read[3]), "logged_restore_s": float(read[4]),
                "read_line": read[0]}
        held = HELD.search(self.text(1))
        if held:
            row["node1_held_b"] = size(held[1])  # node 1's memory: its chunks and the replica
        rdzv = [_stamp(m) for m in RDZV.finditer(self.text(1))]
        if rdzv:
            row["to_rendezvous_s"] = max(rdzv) - t0
        return row


def _stamp(m: re.Match[str]) -> float:
    """The epoch time of a torchrun log line's glog prefix (local time, this year)."""
    now = time.localtime()
    sec = float(m[5])
    t = time.mktime((now.tm_year, int(m[1]), int(m[2]), int(m[3]), int(m[4]), int(sec),
                     0, 0, -1))
    return t + sec - int(sec)


def report(rows: list[dict[str, Any]], a: argparse.Namespace, meta: dict[str, Any]
           ) -> dict[str, Any]:
    out: dict[str, Any] = {**meta, "modes": {}}
    keys = ("total_s", "to_rendezvous_s", *PHASES, "to_restored_s", "logged_restore_s",
            "from_memory_b",
            "from_peers_b", "from_store_b")
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        out["modes"][mode] = {k: summary([r[k] for r in mine]) for k in keys
                              if mine and all(k in r for r in mine)}
    med = {m: out["modes"][m] for m in MODES if out["modes"][m]}
    if "peer" in med and "store" in med:
        out["peer_over_store"] = {
            k: med["peer"][k]["median"] / med["store"][k]["median"]
            for k in ("total_s", "to_restored_s", "restore_s", "logged_restore_s")}
    out["rows"] = rows
    return out


def table(out: dict[str, Any]) -> None:
    print("\nseconds, min / median / max over the rounds (max over the 4 ranks in each)")
    labels = {"total_s": "kill -> first step() on every rank",
              "to_rendezvous_s": "  kill -> rendezvous complete (node 1's agent)",
              "to_start_s": "  kill -> workers' interpreters started",
              "init_s": "  imports + process group",
              "build_s": "  model, DDP, Adam, manager built",
              "restore_s": "  restore() (the worker's clock)",
              "first_step_s": "  first training step + step()",
              "to_restored_s": "kill -> restore() returned on every rank",
              "logged_restore_s": "ciuic's restore as logged (rank 0)"}
    for mode in MODES:
        stats = out["modes"][mode]
        if not stats:
            continue
        print(f"{mode}:")
        for k, label in labels.items():
            if k in stats:
                s = stats[k]
                print(f"  {label:48s} {s['min']:7.2f} / {s['median']:7.2f} / {s['max']:7.2f}")
        b = {k: stats[k]["median"] / 2**30 for k in ("from_memory_b", "from_peers_b",
                                                     "from_store_b")}
        print(f"  GiB read (median, all ranks): this node's memory {b['from_memory_b']:.2f}, "
              f"other nodes' {b['from_peers_b']:.2f}, the store {b['from_store_b']:.2f}")
    if "peer_over_store" in out:
        print("peer / store (medians): " + ", ".join(
            f"{k} {v:.2f}x" for k, v in out["peer_over_store"].items()) + " (goal <= 0.3x)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--gib", type=float, default=1.0, help="size of model + Adam, about")
    p.add_argument("--every", type=int, default=4, help="snapshot every N steps")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=300.0, help="for each wait")
    p.add_argument("--note", default="", help="a note for the JSON (how ciuic was run)")
    p.add_argument("--dir", type=Path, default=Path("/tmp/ciuic-recovery-nodes"))
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" /
                   f"recovery_nodes-{time.strftime('%F')}.json")
    a = p.parse_args()
    fresh(a.dir)
    meta: dict[str, Any] = {"machine": machine(), "when": time.strftime("%F %T %Z"),
                            "ciuic": ciuic_source(),
                            "gib": a.gib, "every": a.every, "step_sleep": a.step_sleep,
                            "rounds": a.rounds, "load_at_start": load(), "note": a.note}
    print(f"machine: {meta['machine']}; load {meta['load_at_start']}", flush=True)
    rows: list[dict[str, Any]] = []
    nodes = Nodes(2)
    t_begin = time.monotonic()
    try:
        nodes.make(2)
        job = Job(nodes, a.dir, a.gib, a.every, a.step_sleep, a.timeout)
        job.start(1)
        job.start(2)
        for r in range(a.rounds):
            order = ("local", "peer") if r % 2 == 0 else ("peer", "local")
            for mode in (*order, "store"):
                row = job.fault(mode)
                row["round"] = r + 1
                rows.append(row)
                print(f"round {r + 1} {mode}: snapshot {row['snapshot']}, total "
                      f"{row['total_s']:.2f} s (start {row['to_start_s']:.2f}, restore "
                      f"{row['restore_s']:.2f}, first step {row['first_step_s']:.2f}); "
                      f"{row['read_line']}; load {row['load']['loadavg_1m']}", flush=True)
    finally:
        logs = {i: str(a.dir / f"node{i}.log") for i in (1, 2)}
        nodes.close()
    meta |= {"wall_s": time.monotonic() - t_begin, "load_at_end": load(), "logs": logs}
    if not rows:
        return
    out = report(rows, a, meta)
    table(out)
    a.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
