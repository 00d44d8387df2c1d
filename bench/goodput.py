"""Goodput under repeated faults (#46): a DDP job runs for ``--minutes`` with a fault every
``--every-s`` seconds (a rank killed, a rank that raises, a rank that hangs, in turn, on rank 1,
then 0, ...), under each system in turn, and the effective training time ratio each reaches:

    .venv/bin/python bench/goodput.py [--minutes 10] [--every-s 60] [--rounds 1]
        [--ranks 2] [--snapshot-every 25] [--hang-timeout 10] [--json FILE]

- ``ciuic-inprocess``: ``ciuic run --nproc-per-node R --spares 1`` (bench/goodput_worker.py's
  function is wrapped in ``ciuic.recoverable``): the survivors stay in their processes, a warm
  spare takes a killed rank's place, every rank rolls back to the latest snapshot from memory;
- ``ciuic-restart``: ``ciuic run -- torchrun --nproc-per-node R`` (the same script): every
  fault restarts every process, which restores from ``ciuic run``'s host memory;
- ``torchrun-dcp``: ``torchrun --max-restarts 100`` and ``torch.distributed.checkpoint``
  every ``--snapshot-every`` steps, saved synchronously (the worker's ``--mode dcp``).

The clock starts at the job's first step; the faults come at every ``--every-s`` from there
(each moved by up to a quarter of it, the same moves for every system);
at ``--minutes`` the job is killed. Progress is the step reached then (rank 0's log, one line a
step). ETTR is progress x the ideal step time / the wall time, the ideal step time being the
median step of the job with no checkpoint at all (``--mode none``, measured first, for
``--baseline-s``); it counts the checkpoints' own cost, the restarts and the steps redone. For
each fault: the time from the fault to the first step after the rollback (rank 0's log), and
the steps lost (redone). Hangs are detected by each system's own means, given the same
``--hang-timeout``: ``ciuic run``'s heartbeats; for torchrun, the collectives' timeout
(``init_process_group(timeout=)``, whose default is 1800 s).

- ``torchft`` (with ``--torchft FOLDER``, where torchft 0.2.0 is installed): its lighthouse,
  and one replica group of one rank per rank, each under ``torchrun --max-restarts``; a
  group's fault leaves it out of the quorum while the others train on, and it heals from a
  peer when it is back. Its useful steps are the batches committed / the groups (a step of
  one group of two is half a step), and its recovery is from the fault to the first step of
  every group again.

NVIDIA's in-process restart is not run: nvidia-resiliency-ext's wheels need Python 3.12 and
glibc 2.39 (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.recovery import summary  # noqa: E402
from tests.s3server import free_port  # noqa: E402

WORKER = Path(__file__).with_name("goodput_worker.py")
SYSTEMS = ("ciuic-inprocess", "ciuic-restart", "torchrun-dcp")
FAULTS = ("kill", "raise", "hang")
PY = sys.executable


def commands(system: str, a: argparse.Namespace, folder: Path) -> list[tuple[list[str],
                                                                            dict[str, str]]]:
    """The processes a system's job is, each with its own environment additions (with
    ``--nodes`` above 1: one per node, node 0's first; see :func:`node_commands`)."""
    ciuic, worker = ciuic_worker(a, folder)
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(a.ranks)]
    if a.nodes > 1 and system not in ("none", "torchft"):
        return [node_commands(system, a, folder, k, ciuic, worker) for k in range(a.nodes)] + (
            [spare_node(a, 0, ciuic, worker)] if system == "ciuic-inprocess" else [])
    if system == "ciuic-inprocess":
        return [([*ciuic, "--nproc-per-node", str(a.ranks), "--spares", "1", "--", PY, *worker,
                  "--mode", "ciuic"], {})]
    if system == "ciuic-restart":
        return [([*ciuic, "--", *torchrun, *worker, "--mode", "ciuic"], {})]
    if system == "torchrun-dcp":
        return [([*torchrun, "--max-restarts", "1000", *worker, "--mode", "dcp", "--timeout",
                  str(a.hang_timeout)], {})]
    if system == "none":
        return [([*torchrun, *worker, "--mode", "none"], {})]
    if system == "torchft":  # its lighthouse, and one torchrun (of one rank) per replica group
        port = free_port()
        # its console script (lighthouse_main parses the process's own argv, from the 2nd)
        lighthouse = [PY, str(Path(a.torchft) / "bin" / "torchft_lighthouse"),
                      "--min_replicas", "1", "--bind",
                      f"[::]:{port}", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
        one = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "--max-restarts", "1000", *worker, "--mode", "torchft", "--timeout",
               str(a.hang_timeout)]
        return [(lighthouse, {})] + [
            (one, {"REPLICA_GROUP_ID": str(r), "TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"})
            for r in range(a.ranks)]
    raise ValueError(system)


def ciuic_worker(a: argparse.Namespace, folder: Path) -> tuple[list[str], list[str]]:
    """``ciuic run``'s options common to its systems, and the worker's command."""
    ciuic = [PY, "-m", "ciuic", "run", "--max-restarts", "1000", "--max-stalls", "1000",
             "--hang-timeout", str(a.hang_timeout), "--grace", "1", "--backoff", "0"]
    worker = [str(WORKER), "--dir", str(folder), "--every", str(a.snapshot_every),
              "--step-s", str(a.step_s), "--hidden", str(a.hidden)]
    return ciuic, worker


def node_commands(system: str, a: argparse.Namespace, folder: Path, k: int, ciuic: list[str],
                  worker: list[str]) -> tuple[list[str], dict[str, str]]:
    """Node ``k``'s process of a job of ``--nodes`` nodes on this machine (each its share of
    the ranks; node 0 hosts the rendezvous): ``ciuic run --nnodes`` in-process (node 0
    leads), or a torchrun of the c10d rendezvous (under ``ciuic run`` for the full restart)."""
    per = a.ranks // a.nodes
    if system == "ciuic-inprocess":
        return ([*ciuic, "--nproc-per-node", str(per), "--nnodes", str(a.nodes), "--node-rank",
                 str(k), "--master-addr", "127.0.0.1", "--master-port", str(a.port),
                 "--spares", "1", "--", PY, *worker, "--mode", "ciuic"], {})
    torchrun = [PY, "-m", "torch.distributed.run", "--nnodes", str(a.nodes), "--nproc-per-node",
                str(per), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{a.port}",
                "--rdzv-id", f"goodput-{a.port}", "--rdzv-conf", f"is_host={int(k == 0)}",
                "--max-restarts", "1000", "--monitor-interval", "0.2"]
    if system == "ciuic-restart":
        return [*ciuic, "--", *torchrun, *worker, "--mode", "ciuic"], {}
    if system == "torchrun-dcp":
        return [*torchrun, *worker, "--mode", "dcp", "--timeout", str(a.hang_timeout)], {}
    raise ValueError(system)


def spare_node(a: argparse.Namespace, n: int, ciuic: list[str],
               worker: list[str]) -> tuple[list[str], dict[str, str]]:
    """The ``n``-th spare node of ``ciuic run --nnodes`` in-process (its warm spares take a
    lost node's ranks; the benchmark starts the next when one has taken a place, as a
    scheduler replaces a lost node)."""
    per = a.ranks // a.nodes
    return ([*ciuic, "--nproc-per-node", str(per), "--nnodes", str(a.nodes), "--node-rank",
             str(a.nodes + n), "--master-addr", "127.0.0.1", "--master-port", str(a.port),
             "--spares", str(per), "--", PY, *worker, "--mode", "ciuic"], {})


#: time, step, rank 0's life (pid.generation), and for torchft the batches every replica
#: group committed so far and the groups in this step's quorum
Row = tuple[float, int, str, int, int]


def steps(folder: Path) -> list[Row]:
    """Every step logged (``steps.log``: rank 0; torchft: ``steps-R.log`` of each other
    group too), in time order."""
    rows = []
    for log in sorted(folder.glob("steps*.log")):
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) in (3, 5):  # a line cut by a kill is left out
                more = (int(parts[3]), int(parts[4])) if len(parts) == 5 else (0, 0)
                rows.append((float(parts[0]), int(parts[1]), parts[2], *more))
    return sorted(rows)


def stop(procs: list[subprocess.Popen[bytes]], folder: Path) -> None:
    """Kill the job: each process's group, and every process that names its folder (ciuic
    run's ranks and spares, torchrun's workers)."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    subprocess.run(["pkill", "-9", "-f", str(folder)], check=False)
    for proc in procs:
        proc.wait(30)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def lose_node(node: subprocess.Popen[bytes]) -> None:
    """A node lost, all of it at once: every process under the one the benchmark started for
    it, SIGKILLed."""
    for p in descendants(node.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    node.wait(30)


def faults_of(system: str, a: argparse.Namespace) -> tuple[str, ...]:
    """The faults injected in turn: a node's loss too where the job has several nodes (for
    torchft, a replica group's: its torchrun and its rank)."""
    several = a.nodes > 1 and system != "none"
    return (*FAULTS, "node") if several else FAULTS


def inject(kind: str, rank: int, folder: Path) -> None:
    if kind == "kill":
        pid = int((folder / f"pid-{rank}").read_text())
        os.kill(pid, signal.SIGKILL)
    else:
        tmp = folder / f"fault-{rank}.tmp"
        tmp.write_text(kind)
        os.replace(tmp, folder / f"fault-{rank}")


def run(system: str, a: argparse.Namespace, folder: Path, seconds: float,
        faults: bool) -> dict[str, Any]:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    # torchrun's agent shares its rendezvous store with the workers by default: a restarted
    # worker then found the last generation's gloo addresses and failed to connect (seen
    # after a raise), and the restart took more than 14 s; ciuic run sets this for its
    # torchrun too (cli/run.torchrun_env)
    path = [str(ROOT / "src"), *([a.torchft] if system == "torchft" else [])]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(path),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if system == "torchft":  # its Manager connects to the agent's store, which it needs
        del env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]
    err = (folder / "stderr.log").open("wb")
    a.port = free_port()  # node 0's rendezvous or control store, with --nodes

    def start(cmd: list[str], more: dict[str, str]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                env={**env, **more}, start_new_session=True)
        started[proc.pid] = (cmd, more)
        return proc

    started: dict[int, tuple[list[str], dict[str, str]]] = {}
    procs = [start(cmd, more) for cmd, more in commands(system, a, folder)]
    kinds = faults_of(system, a)
    # with --nodes: the process of node 1 (torchft: replica group 1), lost by a node fault,
    # and (ciuic in-process) the spare node ready to take its place
    several = "node" in kinds
    node1 = (procs[-1] if system == "torchft" else procs[1]) if several else None
    ready = procs[2] if system == "ciuic-inprocess" and several else None
    spares = 1  # ciuic in-process: the spare nodes started
    try:
        t_launch = time.time()
        while not steps(folder):
            if any(p.poll() is not None for p in procs) or time.time() - t_launch > 300:
                raise RuntimeError(f"{system}: no step within 300 s; see {folder}/stderr.log")
            time.sleep(0.05)
        t0 = steps(folder)[0][0]
        start_s = t0 - t_launch
        injected: list[dict[str, Any]] = []
        k = 0
        while time.time() < t0 + seconds:
            # the same jitter for every system: a fault's place in the snapshot interval
            # varies, as it does in a real job, not with the step time of each system
            due = t0 + (k + 1 + random.Random(k).uniform(-0.25, 0.25)) * a.every_s
            if faults and due < t0 + seconds and time.time() >= due:
                kind, rank = kinds[k % len(kinds)], (k + 1) % a.ranks
                before = steps(folder)
                try:
                    if kind == "node":  # node 1 (never node 0: the leader, the rendezvous)
                        assert node1 is not None
                        rank = a.ranks // a.nodes
                        lose_node(node1)
                        procs.remove(node1)
                        if ready is not None:  # its place taken; the next spare node
                            node1, ready = ready, start(*spare_node(a, spares,
                                                                    *ciuic_worker(a, folder)))
                            procs.append(ready)
                            spares += 1
                        else:  # the lost node started again (a scheduler's replacement)
                            node1 = start(*started[node1.pid])
                            procs.append(node1)
                    else:
                        inject(kind, rank, folder)
                except (OSError, ValueError) as e:  # a pid file not written yet
                    print(f"  {system}: could not inject {kind} on rank {rank}: {e}",
                          flush=True)
                injected.append({"kind": kind, "rank": rank, "time": time.time(),
                                 "last_step": before[-1][1] if before else -1})
                k += 1
            ended = [p for p in procs if p.poll() is not None]
            if ended:
                raise RuntimeError(f"{system}: the job ended (exit {ended[0].returncode}); "
                                   f"see {folder}/stderr.log")
            time.sleep(0.02)
    finally:
        stop(procs, folder)
        err.close()
    rows = [r for r in steps(folder) if r[0] <= t0 + seconds]
    reached = max(r[1] for r in rows)
    if system == "torchft":  # a step of fewer groups is that share of a step's samples
        useful = max(r[3] for r in rows) / a.ranks
        faults_out = [_healed(f, rows, a.ranks) for f in injected]
    else:
        useful = reached + 1
        faults_out = [_recovery(f, rows) for f in injected]
    return {"start_s": start_s, "rows": rows, "reached": reached, "useful_steps": useful,
            "done": len(rows), "faults": faults_out, "wall_s": seconds}


def _recovery(fault: dict[str, Any], rows: list[Row]) -> dict[str, Any]:
    """From the fault to the first step after the rollback: the first step, after the fault,
    of another life of rank 0 (a new process or a new generation); the steps lost are those
    it makes again."""
    prev: Row | None = None
    for row in rows:
        if row[0] >= fault["time"] and prev is not None and row[2] != prev[2]:
            return {**fault, "recovery_s": row[0] - fault["time"],
                    "lost_steps": prev[1] + 1 - row[1]}
        prev = row
    return {**fault, "recovery_s": None, "lost_steps": None}


def _healed(fault: dict[str, Any], rows: list[Row], ranks: int) -> dict[str, Any]:
    """torchft: from the fault to the first step every replica group takes part in again
    (after one that some group missed); nothing is rolled back, so no step is lost: a step
    of fewer groups counts as that share of a step in the useful steps."""
    short = False
    last: dict[str, float] = {}  # each group's last step before the fault, then since
    stall = 0.0  # the longest any group stood still from the fault to the heal
    for t, _, life, _, participants in rows:
        if t < fault["time"]:
            last[life] = t
            continue
        if life in last:
            stall = max(stall, t - max(last[life], fault["time"]))
        last[life] = t
        if participants < ranks:
            short = True
        elif short:
            return {**fault, "recovery_s": t - fault["time"], "lost_steps": 0,
                    "stall_s": stall}
    return {**fault, "recovery_s": None, "lost_steps": 0, "stall_s": stall}


def ideal_step_s(rows: list[Row]) -> float:
    """The median time between two steps of one life (of one torchft group)."""
    lives: dict[str, list[Row]] = {}
    for row in rows:
        lives.setdefault(row[2], []).append(row)
    gaps = [b[0] - a[0] for life in lives.values() for a, b in itertools.pairwise(life)
            if b[1] == a[1] + 1]
    return statistics.median(gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--every-s", type=float, default=60.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1,
                   help="split each system's ranks over this many nodes on this machine (a "
                   "process tree each, node 0 the rendezvous), and add a node's loss to the "
                   "faults: node 1's tree SIGKILLed at once, a replacement started at once "
                   "(ciuic: a spare node ready beforehand, the next started after)")
    p.add_argument("--snapshot-every", type=int, default=25)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--hang-timeout", type=float, default=10.0)
    p.add_argument("--baseline-s", type=float, default=30.0)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--dir", type=Path, default=Path("/tmp/ciuic-goodput"))
    p.add_argument("--json", type=Path)
    p.add_argument("--torchft", help="a folder where torchft is installed (pip install "
                   "--no-deps --target FOLDER torchft==0.2.0): adds torchft to the systems")
    a = p.parse_args()
    known = (*SYSTEMS, "torchft")
    systems = a.systems.split(",")
    if a.torchft and "torchft" not in systems:
        systems.append("torchft")
    unknown = set(systems) - set(known)
    if unknown:
        p.error(f"--systems: unknown {sorted(unknown)}; the systems are {', '.join(known)}")
    if a.nodes < 1 or a.ranks % a.nodes:
        p.error(f"--nodes {a.nodes}: the {a.ranks} ranks split evenly over 1 or more nodes")
    if "torchft" in systems and not a.torchft:
        p.error("torchft needs --torchft FOLDER: where torchft is installed (pip install "
                "--no-deps --target FOLDER torchft==0.2.0)")
    # the ideal step, measured before and after the systems' runs (the VM's speed drifts by a
    # few percent over an hour: one measure moved every ETTR of a run by as much)
    base = run("none", a, a.dir / "none", a.baseline_s, faults=False)["rows"]
    print(f"ideal step (no checkpoint, no fault): {ideal_step_s(base) * 1000:.1f} ms",
          flush=True)
    seconds = a.minutes * 60
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    for r in range(a.rounds):
        for system in systems:  # interleaved
            out = run(system, a, a.dir / system, seconds, faults=True)
            # the checkpointing's own cost, between the faults: its median step / the ideal
            out["steady_step_s"] = ideal_step_s(out["rows"])
            out["redone"] = (out["done"] - (out["reached"] + 1) if system != "torchft"
                             else 0)
            results[system].append(out)
            rec = ", ".join(f"{f['kind']} {f['recovery_s']:.1f} s/{f['lost_steps']}"
                            if f["recovery_s"] is not None else f"{f['kind']} -"
                            for f in out["faults"])
            print(f"round {r + 1} {system}: step {out['reached']} "
                  f"(steady {out['steady_step_s'] * 1000:.1f} ms a step), "
                  f"{out['redone']} redone; start {out['start_s']:.1f} s; faults "
                  f"(recovery/lost steps): {rec}", flush=True)
    after = run("none", a, a.dir / "none", a.baseline_s, faults=False)["rows"]
    t_ideal = statistics.median([ideal_step_s(base), ideal_step_s(after)])
    print(f"ideal step, after: {ideal_step_s(after) * 1000:.1f} ms; the median of both, "
          f"{t_ideal * 1000:.1f} ms, makes the ETTR", flush=True)
    for outs in results.values():
        for out in outs:
            out["ettr"] = out["useful_steps"] * t_ideal / seconds
    report: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": os.cpu_count()},
        "when": time.strftime("%F %T"), "minutes": a.minutes, "every_s": a.every_s,
        "ranks": a.ranks, "nodes": a.nodes, "snapshot_every": a.snapshot_every, "step_s": a.step_s,
        "hidden": a.hidden, "hang_timeout_s": a.hang_timeout, "ideal_step_s": t_ideal,
        "ideal_step_s_before_after": [ideal_step_s(base), ideal_step_s(after)]}
    print("\nmin / median / max")
    for system in systems:
        outs = results[system]
        row: dict[str, Any] = {"ettr": summary([o["ettr"] for o in outs]),
                               "steady_step_s": summary([o["steady_step_s"] for o in outs]),
                               "redone": summary([o["redone"] for o in outs])}
        for kind in (*FAULTS, "node"):
            got = [f for o in outs for f in o["faults"]
                   if f["kind"] == kind and f["recovery_s"] is not None]
            if got:
                row[f"{kind}_recovery_s"] = summary([f["recovery_s"] for f in got])
                if system == "torchft":
                    row[f"{kind}_stall_s"] = summary([f["stall_s"] for f in got])
                row[f"{kind}_lost_steps"] = summary([f["lost_steps"] for f in got])
        row["runs"] = [{k: v for k, v in o.items() if k != "rows"} for o in outs]
        report[system] = row
        print(f"  {system:16s} ETTR " + " / ".join(f"{row['ettr'][m]:.3f}" for m in
                                                    ("min", "median", "max")))
        for kind in (*FAULTS, "node"):
            if f"{kind}_recovery_s" in row:
                s, n = row[f"{kind}_recovery_s"], row[f"{kind}_lost_steps"]
                print(f"  {'':16s} {kind:5s} recovery {s['min']:.2f} / {s['median']:.2f} / "
                      f"{s['max']:.2f} s, lost steps {n['median']:.0f}")
    out_json = a.json or ROOT / "bench" / "results" / f"goodput-{time.strftime('%F')}.json"
    out_json.write_text(json.dumps(report, indent=2))
    print(f"written: {out_json}")


if __name__ == "__main__":
    main()
