"""Recovery benchmark: the time from a fault to the first resumed ``step()`` under ``ciuic
run``, restored from host memory and from the store with a cold page cache, and the time from
the start of a hang to its detection. Interleaved round by round; min/median/max.

    .venv/bin/python bench/recovery.py [--rounds 3] [--scale 1] [--dir /tmp/ciuic-recovery]

The job (bench/recovery_worker.py) holds the 1 GiB reference state of bench/run.py. Its first
start snapshots every 4 steps; after the snapshot of step 4 is committed it drops the store's
files from the page cache (fsync, then ``POSIX_FADV_DONTNEED``), notes the time and SIGKILLs
itself. ``ciuic run`` restarts it; the restart restores and makes one step(). Each figure is
split into: fault -> the restart's interpreter starts (detection, fork, exec), -> its manager
is built (imports, the state built), -> restore() returns, -> the first step() returns.

``--dlrover-run PATH`` adds DLRover's flash checkpoint (bench/recovery_dlrover.py under
``dlrover-run --standalone --max_restarts 1``), in the same rounds; a start that fails is
reported with its error instead of a figure.

The hang variant sleeps instead of dying; ``ciuic run --hang-timeout T`` stops it, and the
detection latency is the silence at detection minus T (the supervisor's log line).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("recovery_worker.py")


def dlrover(dlrover_run: str, folder: Path, scale: int) -> dict[str, float]:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    times = folder / "times.json"
    run = subprocess.run([dlrover_run, "--standalone", "--nproc_per_node=1", "--max_restarts=1",
                          str(WORKER.with_name("recovery_dlrover.py")), "--dir",
                          str(folder / "ckpt"), "--times", str(times), "--scale", str(scale)],
                         capture_output=True, text=True, timeout=900, cwd=folder)
    if run.returncode != 0:
        last = [x for x in run.stderr.splitlines() if x.strip()][-1:]
        raise RuntimeError(f"dlrover-run failed: {last[0] if last else run.returncode}")
    return _split(json.loads(times.read_text()))


def _split(t: dict[str, float]) -> dict[str, float]:
    return {"total_s": t["first_step"] - t["fault"], "to_start_s": t["start"] - t["fault"],
            "to_manager_s": t["manager"] - t["start"], "restore_s": t["restored"] - t["manager"],
            "first_step_s": t["first_step"] - t["restored"]}


def one(kind: str, folder: Path, scale: int, hang_timeout: float) -> dict[str, float]:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    times = folder / "times.json"
    args = [sys.executable, "-m", "ciuic", "run", "--max-restarts", "1",
            "--hang-timeout", str(hang_timeout), "--grace", "1",
            "--host-memory", "off" if kind == "store" else "8G", "--",
            sys.executable, str(WORKER), "--store", str(folder / "store"), "--times", str(times),
            "--scale", str(scale), "--fault", "hang" if kind == "hang" else "kill"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise RuntimeError(f"{kind}: ciuic run failed:\n{run.stderr[-4000:]}")
    t = json.loads(times.read_text())
    from_memory = "Loading snapshot from host memory" in run.stderr
    if kind != "hang" and from_memory != (kind == "memory"):
        raise RuntimeError(f"{kind}: restored {'from' if from_memory else 'not from'} host "
                           f"memory:\n{run.stderr[-3000:]}")
    out = _split(t)
    if kind == "hang":
        m = re.search(r"detected ([\d.]+) s after its last sign of training", run.stderr)
        assert m, run.stderr[-3000:]
        out["detect_over_timeout_s"] = float(m.group(1)) - hang_timeout
    return out


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--hang-timeout", type=float, default=5.0)
    p.add_argument("--dir", type=Path, default=Path("/tmp/ciuic-recovery"))
    p.add_argument("--json", type=Path)
    p.add_argument("--dlrover-run", help="DLRover's dlrover-run, to measure it side by side")
    a = p.parse_args()
    kinds: tuple[str, ...] = ("memory", "store", "hang")
    if a.dlrover_run:
        kinds += ("dlrover",)
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    failed: dict[str, str] = {}
    for r in range(a.rounds):
        for kind in kinds:  # interleaved
            if kind in failed:
                continue
            try:
                row = (dlrover(a.dlrover_run, a.dir / kind, a.scale) if kind == "dlrover"
                       else one(kind, a.dir / kind, a.scale, a.hang_timeout))
            except RuntimeError as e:
                if kind != "dlrover":
                    raise
                failed[kind] = str(e)
                print(f"round {r + 1} {kind}: {e}", flush=True)
                continue
            results[kind].append(row)
            print(f"round {r + 1} {kind}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    kinds = tuple(k for k in kinds if results[k])
    report: dict[str, Any] = {"machine": {"platform": platform.platform(),
                                          "python": platform.python_version(),
                                          "cpus": __import__("os").cpu_count()},
                              "scale": a.scale, "rounds": a.rounds,
                              "hang_timeout_s": a.hang_timeout, "when": time.strftime("%F %T"),
                              "failed": failed}
    for kind in kinds:
        rows = results[kind]
        report[kind] = {k: summary([row[k] for row in rows]) for k in rows[0]}
    mem, cold = report["memory"], report["store"]
    report["ratio_restore"] = mem["restore_s"]["median"] / cold["restore_s"]["median"]
    report["ratio_total"] = mem["total_s"]["median"] / cold["total_s"]["median"]
    print("\nmin / median / max, seconds")
    for kind in kinds:
        for k, s in report[kind].items():
            print(f"  {kind:7s} {k:22s} {s['min']:.3f} / {s['median']:.3f} / {s['max']:.3f}")
    print(f"restore(): memory / cold store = {report['ratio_restore']:.2f}x; fault to first "
          f"step: {report['ratio_total']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
