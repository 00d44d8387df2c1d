"""Training throughput of the demo model with and without a snapshot every 100 steps.

    .venv/bin/python bench/throughput.py [--rounds 3] [--steps 400] [--json FILE]

Runs the demo's training script (``python -m ciuic.demo.train``, a char-level GPT, one thread)
in fresh processes, interleaving the two configurations round by round, and reports training
steps per second (min / median / max) and the slowdown. The snapshot run uses the defaults:
asynchronous, ``on_busy="wait"``, a local store in a fresh temporary directory.
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


def one(steps: int, snapshots: bool, every: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "ciuic.demo.train", "--steps", str(steps),
               "--store", str(Path(tmp) / "store"), "--result", str(result)]
        cmd += ["--save-every", str(every)] if snapshots else ["--no-snapshots"]
        subprocess.run(cmd, check=True, capture_output=True)
        data = json.loads(result.read_text())
    return steps / float(data["train_s"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rates: dict[str, list[float]] = {"no snapshots": [], f"snapshot every {args.every}": []}
    for r in range(args.rounds):
        order = [False, True] if r % 2 == 0 else [True, False]
        for snap in order:
            name = f"snapshot every {args.every}" if snap else "no snapshots"
            rates[name].append(one(args.steps, snap, args.every))
    base = statistics.median(rates["no snapshots"])
    print(f"demo model, {args.steps} steps, {args.rounds} round(s): steps/s min / median / max")
    out: dict[str, Any] = {"steps": args.steps, "rounds": args.rounds, "systems": {}}
    for name, xs in rates.items():
        med = statistics.median(xs)
        print(f"  {name:22} {min(xs):7.2f} / {med:7.2f} / {max(xs):7.2f}   "
              f"{100 * (med / base - 1):+.1f} %")
        out["systems"][name] = {"min": min(xs), "median": med, "max": max(xs)}
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
