"""The stall per snapshot under DeepSpeed: ``engine.save_checkpoint`` against ciuic's
DeepSpeedSnapshots, on the same model, 2 ranks under torchrun (CPU, gloo), ZeRO-1 by default.

    DS_ACCELERATOR=cpu .venv/bin/python bench/ds_stall.py [--rounds 3] [--stage 1] [--json F]

Each round runs both (a fresh process group and store each, the order alternating): 24 steps
of an 8 x 1024 x 1024 MLP stack (8.4 M parameters, 100 MB with AdamW's moments), a snapshot
every 6 steps; the first snapshot (one-time allocations) is left out. Reported (min / median /
max over the snapshots of every round, rank 0 and rank 1 pooled): the time ``step`` (or
``save_checkpoint``) kept the training loop waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("ds_stall_worker.py")


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summary(xs: list[float]) -> str:
    return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    results: dict[str, dict[str, list[float]]] = {m: {"stall": [], "step": []}
                                                  for m in ("ds", "ciuic")}
    with tempfile.TemporaryDirectory(prefix="ciuic-bench-ds-") as base:
        for r in range(a.rounds):
            for mode in ("ds", "ciuic") if r % 2 == 0 else ("ciuic", "ds"):
                out = Path(base) / f"{mode}-{r}.json"
                run = subprocess.run(
                    [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                     "--master_port", str(port()), str(WORKER), "--mode", mode, "--dir",
                     str(Path(base) / f"{mode}-{r}"), "--stage", str(a.stage), "--json",
                     str(out)], capture_output=True, text=True, env=env, timeout=900)
                if run.returncode:
                    raise SystemExit(f"{mode} failed:\n{run.stderr[-3000:]}")
                for rank in json.loads(out.read_text()):
                    results[mode]["stall"] += rank["stalls"]
                    results[mode]["step"].append(rank["step_median"])
    print(f"ZeRO-{a.stage}, 2 ranks, {a.rounds} rounds; seconds, min / median / max")
    for mode, res in results.items():
        name = "engine.save_checkpoint" if mode == "ds" else "ciuic DeepSpeedSnapshots"
        print(f"{name:<26} stall {summary(res['stall'])}   step {summary(res['step'])}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
