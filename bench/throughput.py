"""Training throughput of the demo model with and without a snapshot every 100 steps.

    .venv/bin/python bench/throughput.py [--rounds 3] [--steps 400] [--json FILE]

Runs the demo's training script (``python -m ciuic.demo.train``, a char-level GPT, one thread)
in fresh processes, interleaving the two configurations round by round, and reports training
steps per second (min / median / max) and the slowdown. The snapshot run uses the defaults:
asynchronous, ``on_busy="wait"``, a local store in a fresh temporary directory.

Whole runs differ by several per cent from one to the next on a shared machine, more than a
snapshot costs; so it also reports what the snapshots cost inside each run: the time by which
the steps from each snapshot's step to ``WINDOW`` steps later (the stall, then the background
writing) exceed the run's median step, minus the same for the same steps of the run without
snapshots in that round, per snapshot and as a share of the time of the steps between two
snapshots. The snapshot at step 0 is left out: its window also holds one-time costs (the first
steps, the disk's speed measured at start, the first buffers), which the whole-run figure
includes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Steps from a snapshot's step on that its stall and its background writing can slow (the
#: demo's snapshot is written in about 0.12 s; a step takes about 0.055 s).
WINDOW = 8


def one(steps: int, snapshots: bool, every: int) -> tuple[float, list[float]]:
    """(steps/s, each step's seconds) of one run in a fresh process."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "ciuic.demo.train", "--steps", str(steps),
               "--store", str(Path(tmp) / "store"), "--result", str(result)]
        cmd += ["--save-every", str(every)] if snapshots else ["--no-snapshots"]
        subprocess.run(cmd, check=True, capture_output=True)
        data = json.loads(result.read_text())
    return steps / float(data["train_s"]), [float(t) for t in data["step_s"]]


def excess(step_s: list[float], every: int) -> float:
    """Seconds by which the steps of the windows of the snapshots after step 0 exceed the
    run's median step."""
    assert every >= WINDOW, "windows would overlap"
    base = statistics.median(step_s)
    return sum(t - base for s in range(every, len(step_s), every) for t in step_s[s:s + WINDOW])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rates: dict[str, list[float]] = {"no snapshots": [], f"snapshot every {args.every}": []}
    per_snapshot: list[float] = []  # seconds one snapshot cost the training, per round
    share: list[float] = []  # that / the time of `every` steps: the steady slowdown, per round
    snapshots = len(range(args.every, args.steps, args.every))  # measured: all but step 0's
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        windows: dict[bool, float] = {}
        interval_s = 0.0
        for snap in order:
            name = f"snapshot every {args.every}" if snap else "no snapshots"
            rate, step_s = one(args.steps, snap, args.every)
            rates[name].append(rate)
            windows[snap] = excess(step_s, args.every)
            if snap:
                interval_s = args.every * statistics.median(step_s)
        cost = windows[True] - windows[False]
        per_snapshot.append(cost / snapshots)
        share.append(cost / snapshots / interval_s)
    base = statistics.median(rates["no snapshots"])
    print(f"demo model, {args.steps} steps, {args.rounds} round(s): steps/s min / median / max")
    out: dict[str, Any] = {"steps": args.steps, "rounds": args.rounds, "systems": {}}
    for name, xs in rates.items():
        med = statistics.median(xs)
        print(f"  {name:22} {min(xs):7.2f} / {med:7.2f} / {max(xs):7.2f}   "
              f"{100 * (med / base - 1):+.1f} %")
        out["systems"][name] = {"min": min(xs), "median": med, "max": max(xs)}
    print(f"  cost of a snapshot inside the run (after step 0; window of {WINDOW} steps, less the "
          f"same steps without snapshots): {1e3 * min(per_snapshot):.0f} / "
          f"{1e3 * statistics.median(per_snapshot):.0f} / {1e3 * max(per_snapshot):.0f} ms, "
          f"{100 * min(share):.2f} / {100 * statistics.median(share):.2f} / "
          f"{100 * max(share):.2f} % of the steps between two snapshots")
    out["snapshot_cost_s"] = per_snapshot
    out["snapshot_cost_share"] = share
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
