"""The goodput model of docs/multinode.md: bench/goodput.py's measured recoveries carried to a
job of 1,024 and 16,384 ranks of the 70B model, failing at Llama 3's rate.

    .venv/bin/python bench/goodput_model.py bench/results/goodput-DATE.json [--init-s 0 60]

For each system, the ETTR (useful time / wall time) of a long job is

    ETTR = (1 - stall / I) x (1 - C / M)

with M the job's mean time between failures, I the snapshot interval, ``stall`` what one
snapshot stops training for, and C the wall time one fault costs on average over the
benchmark's faults (a kill, a raise and a hang in equal parts; with ``--nodes 2``, a node's
loss too):

    C = recovery (measured, per kind of fault; a hang's with the system's own timeout) + the
        extra start at scale (``--init-s``: forming the communicator at W ranks, for every
        system that rolls back; creating the processes' CUDA contexts and reading the
        checkpoint for the systems that restart every process; for a node's loss, its ranks'
        state read from a peer's memory by the node that takes its place, for ciuic) + the
        work redone (I / 2, plus for an asynchronous snapshot the time it takes to be written,
        when a fault rolls back to the snapshot before)

and I chosen by Young and Daly's rule, I = sqrt(2 x stall x M). torchft rolls nothing back:
its C is its survivors' stall, plus its healing time x the share of the job's replica
groups that is lost (one group of ``--group-ranks``). ``torchft-as-run`` counts a hang as
the run saw it: healed as measured (moved to the Manager's timeout), or, where the run saw no
heal (no quorum formed again), a stop until someone restarts the job
(``--manual-restart-s``); ``torchft`` as what it would cost had the hung group been left out
at the Manager's timeout. A node's loss is, for torchft, a replica
group's (its heal as measured, else a kill's).

What is assumed, not measured here, is named by an option and printed with the table.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from ciuic.manager.interval import young_daly

#: Llama 3 (The Llama 3 Herd of Models, 2024, section 3.3.4): 419 unexpected interruptions in a
#: 54-day snapshot of pre-training on 16,384 H100 GPUs
LLAMA3_FAILURES, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54, 16_384
STATE_BYTES = 0.84e12  # the 70B model's fp32 weights and Adam moments (docs/multinode.md)
GIB = 1 << 30
KINDS = ("kill", "raise", "hang")


def mtbf_s(gpus: int) -> float:
    per_gpu_hour = LLAMA3_FAILURES / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)
    return 3600.0 / (per_gpu_hour * gpus)


def recovery(report: dict[str, Any], system: str, kind: str, hang_timeout: float) -> float:
    """The measured median recovery, a hang's moved to ``hang_timeout``."""
    r = float(report[system][f"{kind}_recovery_s"]["median"])
    if kind == "hang":
        r += hang_timeout - float(report["hang_timeout_s"])
    return r


def kinds_of(report: dict[str, Any]) -> tuple[str, ...]:
    """The faults the benchmark injected in equal parts: a node's loss too with ``--nodes``."""
    return (*KINDS, "node") if int(report.get("nodes", 1)) > 1 else KINDS


def model(report: dict[str, Any], a: argparse.Namespace, gpus: int,
          init_s: float) -> dict[str, dict[str, float]]:
    m = mtbf_s(gpus)
    per_rank_gib = STATE_BYTES / gpus / GIB
    kinds = kinds_of(report)
    n = len(kinds)
    # a node's loss: its ranks' state from a peer's memory, to the node taking its place
    peer_read = ("node" in kinds) * STATE_BYTES / gpus * a.node_ranks / a.peer_bytes_per_s
    out = {}
    for system in ("ciuic-inprocess", "ciuic-restart", "torchrun-dcp", "torchft",
                   "torchft-as-run"):
        if system.partition("-as-")[0] not in report:
            continue
        timeout = (a.ciuic_hang_timeout if system.startswith("ciuic") else
                   a.torchft_timeout if system.startswith("torchft") else a.collective_timeout)
        if system.startswith("torchft"):
            ft = report["torchft"]
            kill = float(ft["kill_recovery_s"]["median"])
            others = [k for k in kinds if k != "hang"]  # a group restarted: a kill's if unseen
            stalls = [float(ft.get(f"{k}_stall_s", ft["kill_stall_s"])["median"])
                      for k in others]
            heals = [float(ft.get(f"{k}_recovery_s", ft["kill_recovery_s"])["median"])
                     for k in others]
            if system == "torchft":
                # assumed, not seen: a hung group left out of the quorum at the Manager's
                # timeout and restarted (nothing watches for hangs) like a killed one
                hang_stall, hang_heal = timeout, timeout + kill
            elif "hang_recovery_s" in ft:
                # as the run saw it: the hung group healed (its hang moved to the timeout)
                hang_heal = recovery(report, "torchft", "hang", timeout)
                hang_stall = float(ft["hang_stall_s"]["median"]) + timeout - float(
                    report["hang_timeout_s"])
            else:
                # as the run saw it: after a hang no quorum formed again (its lighthouse
                # waited for half of the heartbeating replicas, the hung one among them):
                # the job stands until someone restarts it whole
                hang_stall = hang_heal = a.manual_restart_s
            rec = (sum(heals) + hang_heal) / n
            stall = 0.0  # it snapshots nothing; a group heals from a live peer
            groups = max(gpus // a.group_ranks, 2)
            cost = (sum(stalls) + hang_stall) / n + (rec / groups if system == "torchft"
                                                    else 0.0)
            interval = math.inf
        else:
            stall = per_rank_gib * (a.ciuic_stall_s_per_gib if system.startswith("ciuic")
                                    else a.dcp_stall_s_per_gib)
            # an asynchronous snapshot commits once written: the next waits for that (the
            # interval is no shorter), and a fault meanwhile rolls back to the one before
            write = STATE_BYTES / gpus / a.fs_bytes_per_rank
            interval = max(young_daly(stall, m), write)
            lag = write if system.startswith("ciuic") else 0.0
            missing = [k for k in kinds if f"{k}_recovery_s" not in report[system]]
            if missing:
                raise SystemExit(f"{system}: no {', '.join(missing)} recovered in the run: "
                                 "run bench/goodput.py longer (--minutes)")
            rec = sum(recovery(report, system, k, timeout) for k in kinds) / n
            # in its process a survivor keeps its CUDA context; a replaced rank (a kill, a
            # hang, a node's: 2 of 3 faults, 3 of 4) makes one, and every rank waits for it
            replaced = sum(k in ("kill", "hang", "node") for k in kinds) / n
            extra = init_s + (replaced * a.cuda_init_s + peer_read / n
                              if system == "ciuic-inprocess" else
                              a.cuda_init_s + (peer_read / n if system == "ciuic-restart"
                                               else STATE_BYTES / gpus / a.fs_bytes_per_rank))
            cost = rec + extra + interval / 2 + lag
        overhead = 0.0 if math.isinf(interval) else stall / interval
        ettr = (1 - overhead) * (1 - cost / m)
        out[system] = {"mtbf_h": m / 3600, "interval_s": interval, "stall_s": stall,
                       "recovery_s": rec, "cost_s": cost, "ettr": ettr}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("report", type=Path, help="bench/goodput.py's JSON")
    p.add_argument("--gpus", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--init-s", type=float, nargs="+", default=[0.0, 60.0],
                   help="assumed: forming the communicator at W ranks, for every rollback")
    p.add_argument("--cuda-init-s", type=float, default=5.0,
                   help="assumed: a new process's CUDA context and torch.cuda start")
    p.add_argument("--fs-bytes-per-rank", type=float, default=1e9,
                   help="assumed: a rank's share of the file system's bandwidth: DCP's load "
                   "(ciuic restores from host memory), an asynchronous snapshot's write")
    p.add_argument("--peer-bytes-per-s", type=float, default=12.5e9,
                   help="assumed: a node's network (100 Gb/s), for a lost node's ranks read "
                   "from a peer's memory by the node that takes its place")
    p.add_argument("--node-ranks", type=int, default=8, help="assumed: the ranks of a node")
    p.add_argument("--ciuic-stall-s-per-gib", type=float, default=0.072,
                   help="measured: ciuic's steady-state stall a GiB (docs/benchmarks.md)")
    p.add_argument("--dcp-stall-s-per-gib", type=float, default=1.57,
                   help="measured: dcp.save's time a GiB, FSDP2, 4 ranks (docs/benchmarks.md)")
    p.add_argument("--ciuic-hang-timeout", type=float, default=60.0,
                   help="ciuic run --hang-timeout (heartbeats: a snapshot or restore is no hang)")
    p.add_argument("--collective-timeout", type=float, default=600.0,
                   help="torchrun's only hang detection: the collectives' timeout (NCCL's "
                   "default 600 s)")
    p.add_argument("--torchft-timeout", type=float, default=60.0,
                   help="torchft's Manager timeout (its default): a hung group is left out")
    p.add_argument("--manual-restart-s", type=float, default=1800.0,
                   help="assumed: how long a job that stopped making progress stands until "
                   "someone restarts it (torchft after a hang, as the run saw it)")
    p.add_argument("--group-ranks", type=int, default=512,
                   help="torchft: the ranks of one replica group (the HSDP shard group)")
    a = p.parse_args(argv)
    report = json.loads(a.report.read_text())
    results: dict[str, Any] = {}
    print(f"assumed: --init-s {a.init_s}, CUDA start {a.cuda_init_s:g} s, file system "
          f"{a.fs_bytes_per_rank / 1e9:g} GB/s a rank, ciuic hang timeout "
          f"{a.ciuic_hang_timeout:g} s, "
          f"collectives' timeout {a.collective_timeout:g} s, torchft's {a.torchft_timeout:g} s, "
          f"its groups of {a.group_ranks} ranks")
    print("| ranks | start at scale | system | MTBF | interval | stall | recovery | "
          "cost a fault | ETTR |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gpus in a.gpus:
        for init_s in a.init_s:
            rows = model(report, a, gpus, init_s)
            results[f"{gpus}/{init_s:g}"] = rows
            for system, r in rows.items():
                interval = "-" if math.isinf(r["interval_s"]) else f"{r['interval_s']:.0f} s"
                print(f"| {gpus:,} | {init_s:g} s | {system} | {r['mtbf_h']:.1f} h | "
                      f"{interval} | {r['stall_s']:.3f} s | {r['recovery_s']:.1f} s | "
                      f"{r['cost_s']:.0f} s | {r['ettr']:.4f} |")
    return results


if __name__ == "__main__":
    main()
