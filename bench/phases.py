"""Where a snapshot's time goes: the phases of a full snapshot, an incremental one (10 % of the
tensors changed) and a later one (every tensor changed, the steady state) of bench/run.py's
module state, against the disk's direct-write floor.

    .venv/bin/python bench/phases.py [--rounds 5] [--optimizer adam|adamw] [--dir /var/tmp/x]
                                     [--vary write_threads=2,4]

Each round builds a manager on a fresh local store as a job does (``restore()``, then
``step()``), takes the full snapshot, the incremental one, then the later one, and times, by
wrapping ciuic's own functions for the run (nothing else changes): the stall and its parts
(capture: walking the module's and optimizer's state; staging: the copy, with the comparison of
unchanged chunks for the incremental one), the writer thread's parts (the chunks' naming and
writing, the fsyncs, the commit: body, manifest, catalog; then the bookkeeping after the
commit), and the CPU seconds spent hashing (BLAKE3) and reducing the health statistics, summed
over the threads. The floor: the state's size written with direct I/O in 4 MiB blocks, then
fsync, as ``dd oflag=direct`` does. Prints min/median/max. ``--vary KNOB=V1,V2,...`` measures
several values of one of ``ciuic.knobs`` (``chunk_bytes``, ``write_threads``...) in alternation
within each round.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from measure import direct_floor, machine, nbytes, summary
from states import build, changed, tenth_changed

WALL = ("stall", "capture", "stage", "write_leaves", "sync", "commit", "after_commit",
        "durable")
CPU = ("hash_cpu", "stats_cpu", "write_thread_s")


class Phases:
    """Wraps functions to add their wall (or thread CPU) time to named totals."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self.lock = threading.Lock()
        self.undo: list[tuple[Any, str, Any]] = []

    def add(self, key: str, dt: float) -> None:
        with self.lock:
            self.t[key] = self.t.get(key, 0.0) + dt

    def wrap(self, owner: Any, name: str, key: str, cpu: bool = False) -> None:
        fn = getattr(owner, name)
        clock: Callable[[], float] = time.thread_time if cpu else time.perf_counter

        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                self.add(key, clock() - t0)

        self.undo.append((owner, name, fn))
        setattr(owner, name, timed)

    def restore(self) -> None:
        for owner, name, fn in reversed(self.undo):
            setattr(owner, name, fn)


def instrument(p: Phases) -> None:
    from ciuic.chain import writer
    from ciuic.engine.staging import StagingArea
    from ciuic.format import stats
    from ciuic.format.crypto import ObjectCodec
    from ciuic.manager.pipeline import LocalPipeline
    from ciuic.store.local import LocalStore

    p.wrap(LocalPipeline, "capture", "capture")
    p.wrap(StagingArea, "stage", "stage")
    p.wrap(writer, "write_leaves", "write_leaves")
    p.wrap(writer, "commit_snapshot", "commit")
    p.wrap(LocalStore, "sync", "sync")
    p.wrap(LocalStore, "_write_tmp", "write_thread_s")
    p.wrap(ObjectCodec, "name", "hash_cpu", cpu=True)
    p.wrap(stats, "compute", "stats_cpu", cpu=True)
    write = LocalPipeline.write

    def write_then(self: Any, step: int, captured: Any, *rest: Any) -> Any:
        out = write(self, step, captured, *rest)
        p.add("written_at", time.perf_counter())  # the commit is done
        return out

    p.undo.append((LocalPipeline, "write", write))
    LocalPipeline.write = write_then  # type: ignore[method-assign]


def one_round(base: Path, state: Any, p: Phases) -> dict[str, dict[str, float]]:
    from ciuic import SnapshotManager

    model, opt = state.objects
    store = base / "store"
    shutil.rmtree(store, ignore_errors=True)
    out: dict[str, dict[str, float]] = {}
    m = SnapshotManager("bench", job="phases", store=store, save_interval=2, keep_last=2,
                        handle_signals=False)
    try:
        m.restore(model, opt)  # nothing to restore: the staging buffers are allocated ahead
        m.step(1, model, opt)
        m.wait()

        def snapshot(step: int) -> dict[str, float]:
            p.t.clear()
            t0 = time.perf_counter()
            m.step(step, model, opt)
            stall = time.perf_counter() - t0
            m.wait()
            done = time.perf_counter()
            t = dict(p.t)
            t["stall"], t["durable"] = stall, done - t0
            t["after_commit"] = done - t.pop("written_at", done)
            t["new_bytes"] = float(m.latest().new_bytes)  # type: ignore[union-attr]
            return t

        out["full"] = snapshot(2)
        m.step(3, model, opt)
        with (tenth_changed(state.flat) if state.trainable is None
              else changed(state.flat, names=state.trainable)):
            out["incremental"] = snapshot(4)
        m.step(5, model, opt)
        with changed(state.flat, by=2e-3):  # every byte differs from the incremental one's
            out["later"] = snapshot(6)
    finally:
        m.close(final=False)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--optimizer", choices=["adam", "adamw"], default="adam")
    ap.add_argument("--state", choices=["module", "lora"], default="module",
                    help="bench/states.py's module + Adam, or the frozen base with LoRA "
                         "adapters (its incremental snapshot: the adapters changed)")
    ap.add_argument("--scale", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--vary", default=None, metavar="KNOB=V1,V2",
                    help="values of one of ciuic.knobs, measured in alternation")
    a = ap.parse_args(argv)
    from ciuic import knobs

    knob, values = "chunk_bytes", [knobs.get().chunk_bytes]
    if a.vary:
        knob, _, listed = a.vary.partition("=")
        kind = type(getattr(knobs.get(), knob))
        values = [kind(float(x)) if kind in (int, bool) else kind(x)
                  for x in listed.split(",")]
    base = a.dir or Path(tempfile.mkdtemp(prefix="ciuic-phases-", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    state = build(a.state, a.scale, "cpu", a.optimizer)
    size = nbytes(state.flat)
    p = Phases()
    instrument(p)
    rounds: dict[Any, list[dict[str, dict[str, float]]]] = {v: [] for v in values}
    floors: list[float] = []
    try:
        for _ in range(a.rounds):
            floors.append(direct_floor(base, size))
            for value in values:
                with knobs.override(**{knob: value}):
                    rounds[value].append(one_round(base, state, p))
    finally:
        p.restore()
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"state {a.state}: {len(state.flat)} tensors, {size / 2**30:.3f} GiB ({a.optimizer}); "
          f"{a.rounds} rounds; machine: {machine()}")
    print(f"direct-write floor of the state's size (4 MiB blocks + fsync): {summary(floors)} s")
    for value, runs in rounds.items():
        _report(runs, size, statistics.median(floors),
                f"{knob}={value}, " if len(values) > 1 else "")
    out = {"state": a.state, "state_bytes": size, "optimizer": a.optimizer, "floor": floors,
           "rounds": rounds[values[0]] if len(values) == 1 else
           {f"{knob}={v}": r for v, r in rounds.items()}, "machine": machine()}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


def _report(rounds: list[dict[str, dict[str, float]]], size: int, floor: float,
            title: str) -> None:
    for kind in ("full", "incremental", "later"):
        print(f"\n{title}{kind} snapshot, seconds (min / median / max):")
        for key in (*WALL, *CPU):
            xs = [r[kind].get(key, 0.0) for r in rounds]
            print(f"  {key:<16} {summary(xs)}")
        new = statistics.median(r[kind]["new_bytes"] for r in rounds)
        print(f"  new bytes        {new / size:.3f} of the state")
    full = statistics.median(r["full"]["durable"] for r in rounds)
    inc = statistics.median(r["incremental"]["durable"] for r in rounds)
    later = statistics.median(r["later"]["durable"] for r in rounds)
    print(f"\n{title}incremental / full, durable: {inc / full:.3f}; full durable / "
          f"direct-write floor: {full / floor:.3f}; later durable / direct-write floor: "
          f"{later / floor:.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
