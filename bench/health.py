"""What snapshot health costs the writer: a full snapshot of the 1 GiB reference state, with the
statistics computed while hashing (``health=True``, the default) and without (``health=False``),
to a local disk and to memory (where the writer's CPU is all there is), compression off so that
nothing else differs. Rounds interleaved, the order alternating.

    .venv/bin/python bench/health.py [--rounds 5] [--json FILE]

Reported per configuration (min / median / max): the stall of ``step()`` and the time until the
snapshot is committed (durable on the local disk).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location("bench_run", Path(__file__).with_name("run.py"))
assert _spec and _spec.loader
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def once(store: str, health: bool, state: dict[str, Any]) -> tuple[float, float]:
    from ciuic import SnapshotManager, StateHolder

    with SnapshotManager("bench", job="health", store=store, save_interval=2,
                         handle_signals=False, compression="off", health=health) as m:
        m.step(1, state=StateHolder(state))  # not due: staging buffers allocated ahead
        m.wait()
        t0 = time.perf_counter()
        m.step(2, state=StateHolder(state))
        stall = time.perf_counter() - t0
        m.wait()
        durable = time.perf_counter() - t0
    return stall, durable


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scale", type=int, default=1, help="divide the state's dimensions")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    state = run.reference_state(a.scale)
    size = run.nbytes(state)
    base = Path(tempfile.mkdtemp(prefix="ciuic-bench-health-"))
    configs = [(where, health) for where in ("disk", "memory") for health in (True, False)]
    out: dict[str, dict[str, list[float]]] = {
        f"{w}:health={'on' if h else 'off'}": {"stall": [], "durable": []} for w, h in configs}
    for r in range(a.rounds):
        for k, (where, health) in enumerate(configs if r % 2 == 0 else configs[::-1]):
            store = (str(base / f"s{r}-{k}") if where == "disk"
                     else f"memory://health-{r}-{k}")
            run.release_freed_memory()
            stall, durable = once(store, health, state)
            res = out[f"{where}:health={'on' if health else 'off'}"]
            res["stall"].append(stall)
            res["durable"].append(durable)
            shutil.rmtree(base / f"s{r}-{k}", ignore_errors=True)
            if where == "memory":  # free the 1 GiB it holds
                from ciuic.store import memory

                memory._NAMED.pop(f"health-{r}-{k}", None)
    shutil.rmtree(base, ignore_errors=True)
    print(f"state: {len(state)} tensors, {size / 2**30:.3f} GiB; machine: {run.machine()}")
    print(f"{'configuration':<22} {'stall s':>24} {'committed s':>24}")
    for name, res in out.items():
        print(f"{name:<22} {run.summary(res['stall']):>24} {run.summary(res['durable']):>24}")
    for where in ("disk", "memory"):
        on = statistics.median(out[f"{where}:health=on"]["durable"])
        off = statistics.median(out[f"{where}:health=off"]["durable"])
        print(f"{where}: health adds {on - off:+.3f} s to the median ({on / off - 1:+.1%})")
    result = {"state_bytes": size, "rounds": a.rounds, "results": out, "machine": run.machine()}
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
