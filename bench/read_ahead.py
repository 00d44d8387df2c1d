"""A cold restore of many small tensors from the Ceph cluster, with and without fetching pack
runs ahead of their readers (``read_ahead_bytes``, chain/packreads.py), alternated in one run.

    .venv/bin/python bench/read_ahead.py [--tensors 256] [--kib 256] [--rounds 6] [--json F]

Starts the test cluster of tests/cluster.py (3 OSDs, 3 replicas, radosgw), saves a state of
``--tensors`` tensors of ``--kib`` KiB each (packed: each is smaller than a chunk) once, then
restores it into new managers (an empty catalog each: a new machine) with read-ahead on (the
knob's default) and off, their order alternating by round. Printed: the restore's wall time
and the process's CPU time, min / median / max over rounds. Every restore is checked equal.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tests import cluster  # noqa: E402

from ciuic import SnapshotManager, StateHolder, knobs  # noqa: E402


def mmm(xs: list[float]) -> list[float]:
    return [min(xs), statistics.median(xs), max(xs)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tensors", type=int, default=256)
    p.add_argument("--kib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    on = knobs.get().read_ahead_bytes
    runs: dict[int, list[tuple[float, float]]] = {on: [], 0: []}
    with cluster.running(block_bytes=8 << 30) as cl:
        os.environ.update(cl.env)
        url = f"s3://{cl.make_bucket()}/bench?endpoint={cl.endpoint}"
        g = torch.Generator().manual_seed(0)
        live = {f"t{i:04d}": torch.randn(a.kib * 256, generator=g) for i in range(a.tensors)}
        with SnapshotManager("bench", job="ahead", store=url, compression="off",
                             asynchronous=False, handle_signals=False) as m:
            info = m.save(1, state=StateHolder(live))
        for r in range(a.rounds):
            for ahead in (on, 0) if r % 2 == 0 else (0, on):
                os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp()  # a new machine's catalog
                with knobs.override(read_ahead_bytes=ahead), SnapshotManager(
                        "bench", job="ahead", store=url, handle_signals=False) as m2:
                    holder = StateHolder({})
                    t0, c0 = time.perf_counter(), time.process_time()
                    m2.restore(state=holder, snapshot=info.id)
                    runs[ahead].append((time.perf_counter() - t0, time.process_time() - c0))
                assert all(torch.equal(holder.state[k], live[k]) for k in live)
    results: dict[str, Any] = {
        "tensors": a.tensors, "kib": a.kib, "rounds": a.rounds,
        "machine": {"cpus": os.cpu_count(), "machine": platform.machine()}}
    print(f"{a.tensors} tensors of {a.kib} KiB from Ceph (3 OSDs, 3 replicas, this machine, "
          f"{os.cpu_count()} CPUs), {a.rounds} rounds; min / median / max")
    for ahead, got in runs.items():
        wall, cpu = mmm([w for w, _ in got]), mmm([c for _, c in got])
        results[f"read_ahead_bytes={ahead}"] = {"s": wall, "cpu_s": cpu}
        print(f"read_ahead_bytes={ahead:<9} restore {' / '.join(f'{x:.3f}' for x in wall)} s"
              f", CPU {' / '.join(f'{x:.3f}' for x in cpu)} s")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
