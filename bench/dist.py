"""Multi-rank benchmark: ciuic against torch.distributed.checkpoint at 1, 2 and 4 ranks.

    .venv/bin/python bench/dist.py [--ranks 1 2 4] [--mib 256] [--rounds 3] [--json FILE]

For each world size, ``torchrun`` (gloo, CPU) runs ``bench/dist_worker.py``: an FSDP2-sharded
state of about ``--mib`` MiB (weights plus Adam's two moments), saved and restored by both
tools in the same run, interleaved. Times are the slowest rank's, min / median / max.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("dist_worker.py")


def one(ranks: int, mib: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ciuic-dist-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", str(WORKER), "--dir", str(Path(tmp) / "data"),
               "--mib", str(mib), "--rounds", str(rounds), "--out", str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode != 0:
            raise SystemExit(f"{ranks} rank(s) failed:\n{run.stderr[-4000:]}")
        return json.loads(out.read_text())  # type: ignore[no-any-return]


def summary(xs: list[float]) -> str:
    return f"{min(xs):6.3f} / {statistics.median(xs):6.3f} / {max(xs):6.3f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    results = {str(n): one(n, a.mib, a.rounds) for n in a.ranks}
    first = next(iter(results.values()))
    print(f"state: {first['state_bytes'] / 2**20:.0f} MiB, FSDP2 over gloo, {os.cpu_count()} "
          "cores; seconds, slowest rank, min / median / max")
    print(f"{'ranks':>5} {'system':<14} {'save':>24} {'restore':>24}")
    for n, res in results.items():
        t = res["times"]
        for tool, save, load in (("dcp", "dcp.save", "dcp.load"),
                                 ("ciuic", "ciuic.save", "ciuic.restore")):
            print(f"{n:>5} {tool:<14} {summary(t[save]):>24} {summary(t[load]):>24}")
    print("time inside step() with no snapshot due, 10 ms apart (the per-step agreement), "
          "microseconds: " + ", ".join(
        f"{n} rank(s) {res['step_us']:.0f}" for n, res in results.items()))
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
