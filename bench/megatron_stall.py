"""The stall per snapshot under megatron-core: Megatron's own asynchronous
``dist_checkpointing.save`` (the ``torch_dist`` strategy, an ``AsyncCallsQueue``) against
ciuic's MegatronSnapshots, on the same model, in one run, interleaved: 2 ranks under torchrun
(CPU, gloo), a GPTModel at TP=2 (local layer spec, fp32; 4 layers, hidden 512, vocab 8192:
about 21 M parameters, 250 MB with Adam's moments, half per rank).

    .venv/bin/python bench/megatron_stall.py [--rounds 1] [--steps 48] [--every 4] [--json F]

Every ``--every`` iterations one of the two saves, alternately (ciuic first); the first of each
(one-time set-up: ciuic's staging buffers, Megatron's writer process) is left out. Reported
(min / median / max over the saves of every round, rank 0 and rank 1 pooled): the time the
call kept the training loop waiting (ciuic: ``snapshots.step``; Megatron: ``save`` and
``schedule_async_request``, its directory made beforehand, untimed); and the median
iteration without a save. Every process a run started is SIGKILLed at its end (Megatron's writer
processes outlive their rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from ds_stall import summary  # beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))
import mg_run

WORKER = Path(__file__).with_name("megatron_stall_worker.py")


def run_round(base: Path, r: int, steps: int, every: int) -> list[dict[str, Any]]:
    out = base / f"round-{r}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(WORKER), "--dir", str(base / f"r{r}"),
               "--steps", str(steps), "--every", str(every), "--json", str(out)]
    done = mg_run.run(command, {**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=1800)
    if done.returncode:
        raise SystemExit(f"round {r} failed:\n{done.stderr[-3000:]}")
    ranks: list[dict[str, Any]] = json.loads(out.read_text())
    return ranks


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    results: dict[str, Any] = {"ciuic": [], "megatron": [], "step": []}
    with tempfile.TemporaryDirectory(prefix="ciuic-bench-megatron-") as base:
        for r in range(a.rounds):
            for rank in run_round(Path(base), r, a.steps, a.every):
                for mode in ("ciuic", "megatron"):
                    results[mode] += rank["stalls"][mode]
                results["step"].append(rank["step_median"])
    print(f"megatron-core TP=2, 2 ranks (CPU, gloo), {a.rounds} round(s) of {a.steps} "
          f"iterations; seconds, min / median / max")
    print(f"{'iteration (no save)':<44} {summary(results['step'])}")
    print(f"{'ciuic MegatronSnapshots.step':<44} {summary(results['ciuic'])}  "
          f"({len(results['ciuic'])} snapshots)")
    print(f"{'Megatron dist_checkpointing.save (async)':<44} {summary(results['megatron'])}  "
          f"({len(results['megatron'])} saves)")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
