"""Snapshot benchmark: ciuic against torch.save, safetensors and torch.distributed.checkpoint.

    .venv/bin/python bench/run.py [--rounds 5] [--dir /tmp/ciuic-bench] [--quick]
        [--state module|gpt1g|h200] [--optimizer adam|adamw]

The state (bench/states.py) is by default a training job's: an ``nn.Sequential`` of 21
``nn.Linear(2048, 2048)`` with ``torch.optim.Adam`` after one step (0.98 GiB of weights and
moments); ``--state gpt1g`` is PERFORMANCE.md's flat "GPT-like 1 GiB" dict, ``--state h200``
the H200 one. Every system is measured in the same run, interleaved round by round (the order
alternates each round): the stall (how long the call blocks training), the time until durable
(fsync'ed), the cold time to restore into the live tensors (the page cache dropped before each
restore: run as root; every system's restore ends in one set of live tensors allocated once, as
a user's ``load_state_dict`` does), the bytes written and the peak extra host memory. For ciuic
also: an incremental snapshot with 10 % of the tensors changed (``--state lora``: the adapters
and their moments, as after a step of LoRA fine-tuning), the rollback (the live manager
restores the latest snapshot, then the one before it) and the restart (a new manager's
restore); and a later snapshot with every tensor changed (the steady state of a job whose
optimizer updates every weight), with its own copy floor. The copy floor of the stall is a
copy of the state into buffers allocated ahead, just before ciuic's snapshot in each round;
the direct-write floor (the state's bytes alone, written as fast as the disk takes them) is
measured at the start or end of each round.
Prints min/median/max, then every ratio of ../shared/docs/PERFORMANCE.md and issue #33.
``--quick`` uses a 1/16-size state, 1 round (the test suite's smoke run).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # its modules, however it is loaded

from measure import (
    RssPeak,
    direct_floor,
    disk_floor,
    drop_caches,
    du,
    fsync_tree,
    machine,
    nbytes,
    release_freed_memory,
    staging_floor,
    summary,
    timed,
)
from states import build, gpt_shapes, reference_state
from systems import (
    DCP,
    Ciuic,
    CiuicCompressed,
    CiuicEncrypted,
    CiuicNoHealth,
    CiuicNoWatch,
    DCPAsync,
    Safetensors,
    System,
    TorchSave,
)

__all__ = ["drop_caches", "fsync_tree", "gpt_shapes", "machine", "main", "nbytes",
           "reference_state", "release_freed_memory", "summary"]
PEERS = ("torch.save", "safetensors", "dcp.save")


def main(argv: list[str] | None = None) -> dict[str, object]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="1/16-size state, 1 round")
    p.add_argument("--json", type=Path, default=None, help="also write results here")
    p.add_argument("--state", choices=["module", "gpt1g", "h200", "lora"], default="module",
                   help="a module of 21 linear layers with Adam (1 GiB, the default), the flat "
                        "GPT-like 1 GiB dict, the H200 state (5.6 GB: bf16 weights, fp32 "
                        "master, Adam), or a frozen 1 GiB base with LoRA adapters (1 %% of the "
                        "parameters, Adam; its incremental snapshot: the adapters changed), "
                        "built on --device")
    p.add_argument("--optimizer", choices=["adam", "adamw"], default="adam",
                   help="the module state's optimizer")
    p.add_argument("--device", default=None,
                   help="where the state lives (default: cuda for h200, else cpu)")
    p.add_argument("--scale", type=int, default=None, help="divide the state's dimensions")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="stop after the round that would leave too little time for another "
                        "(for a run on a lent machine with a time limit; at least one round)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)  # keep the recovery log out of the table
    if not os.environ.get("CIUIC_ENCRYPTION_KEY"):
        from ciuic.format.crypto import generate_key_text

        os.environ["CIUIC_ENCRYPTION_KEY"] = generate_key_text()  # for the ciuic+aes system
    scale = a.scale or (4 if a.quick else 1)
    rounds = 1 if a.quick else a.rounds
    base = a.dir or Path(tempfile.mkdtemp(prefix="ciuic-bench-"))
    device = a.device or ("cuda" if a.state == "h200" else "cpu")
    state = build(a.state, scale, device, a.optimizer)
    live = build(a.state, scale, device, a.optimizer)  # allocated and touched once, as a job's
    size = nbytes(state.flat)
    base.mkdir(parents=True, exist_ok=True)
    write_floor = disk_floor(base, size)
    print(f"disk write floor (64 MiB writes + fsync of the state's size): {write_floor:.3f} s")
    print(f"state {a.state}: {len(state.flat)} tensors, {size / 2**30:.3f} GiB; "
          f"machine: {machine()}")
    systems: list[System] = [
        cls(name, base, state, live) for cls, name in (
            (TorchSave, "torch.save"), (Safetensors, "safetensors"), (DCP, "dcp.save"),
            (DCPAsync, "dcp.async_save"), (Ciuic, "ciuic"), (CiuicEncrypted, "ciuic+aes"),
            (CiuicCompressed, "ciuic+compress"), (CiuicNoHealth, "ciuic-nohealth"),
            (CiuicNoWatch, "ciuic-nowatch"))]
    keys = ("stall", "durable", "load", "bytes", "extra_mem")
    results: dict[str, dict[str, list[float]]] = {s.name: {k: [] for k in keys} for s in systems}
    floor: list[float] = []
    disk: list[float] = []  # the direct-write floor of the state's bytes, each round
    started = time.monotonic()
    for r in range(rounds):
        elapsed = time.monotonic() - started
        if a.deadline_s is not None and r and elapsed + elapsed / r > a.deadline_s:
            print(f"stopping after {r} round(s): another would pass --deadline-s")
            break
        if r % 2 == 0:  # first in even rounds, last in odd ones, as the systems alternate
            disk.append(direct_floor(base, size, threads=4))
        for s in systems if r % 2 == 0 else list(reversed(systems)):
            release_freed_memory()
            if s.name == "ciuic":  # the copy floor just before ciuic's stall: the memory's
                floor.append(staging_floor(state.flat))  # speed drifts over a round
                release_freed_memory()
            with RssPeak() as mem:  # ciuic's staging buffers, allocated in fresh(), count
                s.fresh()
                t0 = time.perf_counter()
                stall = s.save()
                durable = time.perf_counter() - t0
            res = results[s.name]
            res["stall"].append(stall)
            res["durable"].append(durable)
            res["extra_mem"].append(mem.extra)
            res["bytes"].append(du(s.dir))
            if isinstance(s, Ciuic):  # each variant: compression off (auto), sealed, on
                s.incremental()  # 10 % changed since the first snapshot
                s.later()  # every tensor changed since the incremental one
                s.rollbacks()
            drop_caches()
            res["load"].append(timed(s.load))
            s.close()
            shutil.rmtree(s.dir, ignore_errors=True)  # one state on disk at a time
        if r % 2:
            disk.append(direct_floor(base, size, threads=4))
    for s in systems:
        s.close()
    variants = [s for s in systems if isinstance(s, Ciuic)]
    report(results, variants, floor, disk, size)
    ciuic = variants[0]
    out: dict[str, object] = {"state_bytes": size, "rounds": len(floor), "results": results,
                              "state": a.state, "optimizer": a.optimizer, "device": device,
                              "disk_write_floor": write_floor, "staging_floor": floor,
                              "direct_write_floor": disk,
                              "ciuic_incremental": ciuic.steady,
                              "incremental": {v.name: v.steady for v in variants},
                              "ciuic_auto_compression": ciuic.basis,
                              "ratios": ratios(results, ciuic, floor, disk, size),
                              "machine": machine()}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    if a.dir is None:
        shutil.rmtree(base, ignore_errors=True)
    return out


def report(results: dict[str, dict[str, list[float]]], variants: list[Ciuic],
           floor: list[float], disk: list[float], size: int) -> None:
    print(f"\nstaging floor (copy into preallocated buffers): {summary(floor)} s")
    print(f"direct-write floor (the state's bytes in 4 MiB files, direct, 4 threads, fsync): "
          f"{summary(disk)} s")
    print(f"\n{'system':<15} {'stall s':>24} {'durable s':>24} {'cold restore s':>24}"
          f" {'bytes/state':>11} {'extra mem/state':>15}")
    for name, res in results.items():
        print(f"{name:<15} {summary(res['stall']):>24} {summary(res['durable']):>24} "
              f"{summary(res['load']):>24} {statistics.median(res['bytes']) / size:11.3f} "
              f"{statistics.median(res['extra_mem']) / size:15.3f}")
    for v in variants:
        st = v.steady
        what = "10 % of tensors" if v.trainable is None else "the adapters and their moments"
        print(f"\n{v.name} incremental ({what} changed, buffers warm): stall "
              f"{summary(st['stall'])} s, durable {summary(st['durable'])} s, "
              f"new bytes {statistics.median(st['new_bytes']) / size:.3f} of the state")
        print(f"{v.name} later snapshot (every tensor changed): stall "
              f"{summary(st['later_stall'])} s (copy floor {summary(st['later_floor'])} s), "
              f"durable {summary(st['later_durable'])} s")
        print(f"{v.name} rollback (the live manager's restore, cold cache): latest "
              f"{summary(st['rollback'])} s, the one before {summary(st['rollback_previous'])}"
              f" s; restart: manager built {summary(st['restart_open'])} s, restore() "
              f"{summary(st['restart_restore'])} s")
    ciuic = variants[0]
    for kind, basis in ciuic.basis.items():
        print(f"ciuic compression=auto, {kind}: " + ", ".join(f"{k} {v:.3g}"
                                                          for k, v in basis.items()))
    print(f"ciuic staging buffers allocated ahead of the first snapshot (background): "
          f"{summary(ciuic.steady['reserve_s'])} s")
    print("\nratios of medians (issue #33's goals):")
    for key, value in ratios(results, ciuic, floor, disk, size).items():
        print(f"  {key:<58} {value:6.3f}")


def ratios(results: dict[str, dict[str, list[float]]], ciuic: Ciuic, floor: list[float],
           disk: list[float], size: int) -> dict[str, float]:
    """Every ratio the goals name, of medians."""
    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    mine, st = results[ciuic.name], ciuic.steady
    fastest_durable = min(PEERS, key=lambda n: med(results[n]["durable"]))
    fastest_load = min(PEERS, key=lambda n: med(results[n]["load"]))
    return {
        "stall / copy floor (<= 1.2)": med(mine["stall"]) / med(floor),
        "stall / dcp.async_save's stall": med(mine["stall"]) / med(
            results["dcp.async_save"]["stall"]),
        f"durable / fastest peer's ({fastest_durable})": med(mine["durable"]) / med(
            results[fastest_durable]["durable"]),
        "durable / dcp.save's (<= 0.85)": med(mine["durable"]) / med(
            results["dcp.save"]["durable"]),
        "durable / the direct-write floor": med(mine["durable"]) / med(disk),
        "dcp.save's durable / the direct-write floor": med(results["dcp.save"]["durable"]) / med(
            disk),
        # the least durable / dcp.save any writer of these bytes reaches on this disk: nothing
        # copied, hashed, named or committed
        "the direct-write floor / dcp.save's durable": med(disk) / med(
            results["dcp.save"]["durable"]),
        f"restart restore / fastest peer's ({fastest_load}) (<= 1.0)": med(mine["load"]) / med(
            results[fastest_load]["load"]),
        "restart restore / torch.load + load_state_dict": med(mine["load"]) / med(
            results["torch.save"]["load"]),
        "rollback (latest) / restart's restore() (<= 1.0)": med(st["rollback"]) / med(
            st["restart_restore"]),
        "rollback (the one before) / restart's restore()": med(st["rollback_previous"]) / med(
            st["restart_restore"]),
        "later stall, every tensor changed / its copy floor (<= 1.2)": med(
            st["later_stall"]) / med(st["later_floor"]),
        "later durable, every tensor changed / the direct-write floor (<= 1.3)": med(
            st["later_durable"]) / med(disk),
        # the LoRA state's incremental snapshot: the adapters and their moments changed
        f"incremental durable / full durable (<= {0.2 if ciuic.trainable is None else 0.05})":
            med(st["durable"]) / med(mine["durable"]),
        "incremental bytes / state (<= 0.12)": med(st["new_bytes"]) / size,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
