"""Scale benchmark: the multi-rank snapshot at 2 to 32 ranks (issue #32, item 5).

    .venv/bin/python bench/scale.py [--ranks 2 4 8 16 32] [--rounds 2] [--params 16]
        [--kib 2048] [--timeout 600] [--synthetic W ...] [--pack-bytes B ...]
        [--objects W ...] [--reshard W:NEW ...] [--chain W W ... [--chain-modes fsdp tp]]
        [--cold-ceph W] [--json FILE]

For each world size W, ``torchrun --standalone`` (gloo, CPU, ``OMP_NUM_THREADS=1``) runs
``bench/scale_worker.py``: two models of ``--params`` parameter tensors, ``--kib`` KiB of state
per rank (weights and Adam's two moments, fp32), FSDP2 (sharded: the global state grows with W,
each rank's does not) and DDP (replicated: every rank holds the whole state), in one process,
interleaved by round. Per round and model: the job's first snapshot (cold: DCP's first
``get_state_dict``) and a second one after a step that changed every tensor (warm: what a
training job pays from then on), the store's bytes, and a restore by a new manager on every
rank. Printed: per world size, min / median / max over rounds of the slowest rank's wall times,
the ranks' CPU times (``time.process_time``) and rank 0's share of them, the body, manifest and
collective bytes. With W ranks on a machine of fewer cores the wall times measure contention;
the CPU times and the bytes do not. Raw figures (every rank, every wrapped call) go to
``--json``. ``--synthetic W ...`` also times, in this one process, rank 0's and a restoring
rank's per-shard work for 2,200 sharded tensors (a 70B model's count) over world sizes this
machine cannot run (``--ranks`` with no value: only that). docs/benchmarks.md, "Scale: 2 to 32
ranks", has a run; docs/multinode.md extrapolates it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).with_name("scale_worker.py")
RESHARD = Path(__file__).with_name("reshard_worker.py")
sys.path.insert(0, str(Path(__file__).parent))
import scale_objects  # noqa: E402  (beside this file, not a package)


def one(ranks: int, a: argparse.Namespace, pack_bytes: int | None = None
        ) -> dict[str, Any] | str:
    """Run one world size (with packs of ``pack_bytes``; None: the knob's default); its raw
    result, or why it failed."""
    with tempfile.TemporaryDirectory(prefix="ciuic-scale-bench-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", str(WORKER), "--dir", str(Path(tmp) / "data"),
               "--rounds", str(a.rounds), "--params", str(a.params), "--kib", str(a.kib),
               "--out", str(out)] + ([] if pack_bytes is None else
                                     ["--pack-bytes", str(pack_bytes)])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)
        try:
            _, err = proc.communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its workers: our session only
            proc.communicate()
            return f"timed out after {a.timeout} s"
        if not out.exists():  # rank 0 writes it once every rank's figures are in
            return f"exit {proc.returncode}:\n{err[-4000:]}"
        res: dict[str, Any] = json.loads(out.read_text())
        res["exit"] = proc.returncode
        for rnd in res["rounds"]:
            for rank in rnd["ranks"]:
                for snap in ("cold", "warm"):
                    rank[snap]["calls"] = compact(rank[snap]["calls"])
                rank["restore_calls"] = compact(rank["restore_calls"])
        res["launch_s"] = time.perf_counter() - t0
        return res


def chain(worlds: list[int], mode: str, timeout: int) -> dict[str, Any]:
    """A job restarted on one world size after another (``bench/reshard_worker.py``, #45 item
    2): each run restores what the previous one saved (on another world size), rank 0 checks
    every tensor against the previous run's whole state, then every rank takes a step and
    snapshots it. Per run: each rank's restore and save times, the parts it read, the plans
    it made (and how many from every rank's metas), its peak RSS."""
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ciuic-reshard-bench-") as tmp:
        for i, world in enumerate(worlds):
            out = Path(tmp) / f"run{i}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={world}", str(RESHARD), "--store", str(Path(tmp) / "store"),
                   "--out", str(out), "--mode", mode, "--step", str(i + 1)]
            if i:
                cmd += ["--restore", "--expect", str(Path(tmp) / f"run{i - 1}" / "full.pt")]
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, timeout=timeout,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if not (out / "result.json").exists():
                return {"mode": mode, "worlds": worlds, "runs": runs,
                        "error": f"{world} ranks: exit {proc.returncode}:\n{proc.stderr[-4000:]}"}
            res = json.loads((out / "result.json").read_text())
            ranks = res["ranks"]
            row: dict[str, Any] = {
                "world": world, "save_s": mmm([r["save_s"][0] for r in ranks]),
                "save_cpu_s": mmm([r["save_s"][1] for r in ranks]),
                "plans": [sum(r["plans"][0] for r in ranks), sum(r["plans"][1] for r in ranks)],
                "max_rss_mb": max(r["max_rss_kib"] for r in ranks) / 1024}
            if i:
                row |= {"restore_s": mmm([r["restore_s"][0] for r in ranks]),
                        "restore_cpu_s": mmm([r["restore_s"][1] for r in ranks]),
                        "parts": mmm([r["parts"][0] for r in ranks]), "of": ranks[0]["parts"][1],
                        "restored": ranks[0]["restored"], "compared": ranks[0]["compared"],
                        "differ": ranks[0]["differ"]}
            runs.append(row)
    return {"mode": mode, "worlds": worlds, "runs": runs}


def compact(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """A rank's wrapped calls of one phase summed by name: ``{name: [calls, bytes sent, wall
    s, CPU s]}`` (each name is called once per phase but the restore's collectives)."""
    out: dict[str, list[float]] = {}
    for c in records:
        agg = out.setdefault(c["what"], [0, 0, 0.0, 0.0])
        for i, v in enumerate((1, c["sent"], c["wall"], c["cpu"])):
            agg[i] += v
    return out


def rounded(x: Any) -> Any:
    """``x`` with every float to 6 significant digits (what the JSON keeps)."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [rounded(v) for v in x]
    return x


def fmt(xs: list[float], digits: int = 2) -> str:
    return " / ".join(f"{x:.{digits}f}" for x in xs)


def mmm(xs: list[float]) -> list[float]:
    return [min(xs), statistics.median(xs), max(xs)]


def calls(rank: dict[str, Any], phase: str, what: str) -> list[dict[str, Any]]:
    """The (summed) calls of ``what`` in a phase: ``[{"n", "sent", "wall", "cpu"}]``, or []."""
    src = rank["restore_calls"] if phase == "restore" else rank[phase]["calls"]
    if what not in src:
        return []
    return [dict(zip(("n", "sent", "wall", "cpu"), src[what], strict=True))]


def _adder(per: dict[str, list[float]]) -> Any:
    def add(key: str, value: float) -> None:
        per.setdefault(key, []).append(value)

    return add


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Per model: the figures of each round, then min / median / max over rounds."""
    world = res["world"]
    out: dict[str, Any] = {}
    for mode in sorted({r["mode"] for r in res["rounds"]}):
        per: dict[str, list[float]] = {}
        add = _adder(per)

        for rnd in (r for r in res["rounds"] if r["mode"] == mode):
            ranks = sorted(rnd["ranks"], key=lambda x: x["rank"])
            r0 = ranks[0]
            for snap in ("cold", "warm"):
                add(f"{snap}.stall_s", max(x[snap]["stall"] for x in ranks))
                add(f"{snap}.commit_s", max(x[snap]["commit"] for x in ranks))
                cpu = [x[snap]["cpu"] for x in ranks]
                add(f"{snap}.cpu_mean_s", statistics.mean(cpu))
                add(f"{snap}.cpu_rank0_s", cpu[0])
                add(f"{snap}.rank0_share", cpu[0] / statistics.mean(cpu))
                # the same without the cyclic GC's pauses (~0.2 s CPU each, at random ranks)
                net = [x[snap]["cpu"] - x[snap]["gc_s"] for x in ranks]
                add(f"{snap}.gc_cpu_mean_s", statistics.mean(x[snap]["gc_s"] for x in ranks))
                add(f"{snap}.gc2_per_rank", statistics.mean(x[snap]["gc2"] for x in ranks))
                add(f"{snap}.cpu_nogc_mean_s", statistics.mean(net))
                add(f"{snap}.cpu_nogc_rank0_s", net[0])
                add(f"{snap}.rank0_share_nogc", net[0] / statistics.mean(net))
                for what in ("stall.capture", "stall.copy"):
                    add(f"{snap}.{what}_s", max(sum(c["wall"] for c in calls(x, snap, what))
                                                for x in ranks))
                add(f"{snap}.stall_cpu_s", statistics.mean(  # this thread's, in the stall
                    sum(c["cpu"] for what in ("stall.capture", "stall.copy")
                        for c in calls(x, snap, what)) for x in ranks))
                # the plan: an all_gather of every rank's metas (padded to the longest)
                plan = [calls(x, snap, "all_gather")[0]["sent"] for x in ranks]
                add(f"{snap}.plan_sent_bytes", statistics.mean(plan))
                add(f"{snap}.plan_received_bytes", world * max(plan))
                add(f"{snap}.plan_wall_s", max(calls(x, snap, "all_gather")[0]["wall"]
                                               for x in ranks))
                add(f"{snap}.plan_cpu_s", statistics.mean(
                    calls(x, snap, "all_gather")[0]["cpu"] for x in ranks))
                add(f"{snap}.owners_cpu_s", statistics.mean(  # 0: the plan was cached
                    sum(c["cpu"] for c in calls(x, snap, "plan.owners")) for x in ranks))
                gather = [calls(x, snap, "gather")[0]["sent"] for x in ranks]
                add(f"{snap}.gather_sent_bytes", statistics.mean(gather))
                add(f"{snap}.gather_rank0_bytes", world * max(gather))
                add(f"{snap}.broadcast_bytes", calls(r0, snap, "broadcast")[0]["sent"])
                for what in ("commit.rank0", "commit.assemble", "commit.health",
                             "commit.encode_body", "commit.catalog"):
                    c = calls(r0, snap, what)[0]
                    add(f"{snap}.{what}_s", c["wall"])
                    add(f"{snap}.{what}_cpu_s", c["cpu"])
            for snap in ("cold", "warm"):  # the store's requests, as S3 would answer them
                req = [x[snap].get("requests", {}) for x in ranks]
                add(f"{snap}.objects", sum(n for r in req for kind, n in r.get(
                    "objects", {}).items() if kind != "inflight"))  # (deleted at the commit)
                for kind in ("chunk", "pack", "body", "manifest"):
                    add(f"{snap}.objects.{kind}", sum(r.get("objects", {}).get(kind, 0)
                                                      for r in req))
                for method in ("PUT", "GET", "HEAD", "LIST"):
                    add(f"{snap}.{method}", sum(r.get(method, 0) for r in req))
                add(f"{snap}.PUT_max_rank", max(r.get("PUT", 0) for r in req))
            req = [x.get("restore_requests", {}) for x in ranks]
            for method in ("GET", "HEAD", "LIST"):
                add(f"restore.{method}", sum(r.get(method, 0) for r in req))
                add(f"restore.{method}_max_rank", max(r.get(method, 0) for r in req))
            add("restore.GET_bytes", sum(r.get("GET_bytes", 0) for r in req))
            add("restore_s", max(x["restore"] for x in ranks))
            cpu = [x["cpu_restore"] for x in ranks]
            add("restore.cpu_mean_s", statistics.mean(cpu))
            add("restore.cpu_rank0_s", cpu[0])
            add("restore.rank0_share", cpu[0] / statistics.mean(cpu))
            net = [x["cpu_restore"] - x["restore_gc_s"] for x in ranks]
            add("restore.gc_cpu_mean_s", statistics.mean(x["restore_gc_s"] for x in ranks))
            add("restore.cpu_nogc_mean_s", statistics.mean(net))
            add("restore.rank0_share_nogc", net[0] / statistics.mean(net))
            for what in ("restore.candidates", "restore.read_body", "restore.boxes",
                         "restore.own_part", "restore.agree"):
                add(f"{what}_s", max(sum(c["wall"] for c in calls(x, "restore", what))
                                     for x in ranks))
                add(f"{what}_cpu_mean_s", statistics.mean(
                    sum(c["cpu"] for c in calls(x, "restore", what)) for x in ranks))
            add("restore.chunk_bytes_per_rank", statistics.mean(x["read_chunk_bytes"]
                                                                for x in ranks))
            add("restore.chunks_per_rank", statistics.mean(x["read_chunks"] for x in ranks))
            s = rnd["store"]
            # a body in parts: what a restoring rank read of it (the index, and its parts)
            sizes = sorted(s.get("part_sizes", []))
            add("restore.body_read_bytes_per_rank", s["body_bytes"] + statistics.mean(
                sum(sizes[-n:]) if n else 0 for n, _ in (x.get("restore_parts", [0, 0])
                                                         for x in ranks)))
            add("restore.parts_per_rank", statistics.mean(
                x.get("restore_parts", [0, 0])[0] for x in ranks))
            for key in ("body_bytes", "parts_bytes", "manifest_bytes", "shard_descriptors",
                        "plain_descriptors", "inline", "chunk_refs", "parse_cpu_s",
                        "parse_peak_bytes"):
                add(key, s[key])
            for part, n in s["body_parts"].items():
                add(f"body.{part}_bytes", n)
            add("tensors", rnd["tensors"])
            if mode == "fsdp" and "requests" in r0["cold"]:  # the writer's rule, predicted
                predicted = [scale_objects.rank_objects(
                    [(res["rows"] * world, res["cols"])] * res["params"], world, x["rank"],
                    chunk=res["chunk_bytes"], pack=res.get("pack_bytes", 0), inline=256)
                    for x in ranks]
                add("cold.objects.predicted", sum(p["objects"] for p in predicted))
        out[mode] = {k: mmm(v) for k, v in per.items()}
    return out


def table(results: dict[str, Any]) -> None:
    def f(s: dict[str, Any], key: str) -> str:
        return "/".join(f"{x:.3f}" for x in s[key])

    print("warm snapshot (after a step that changed every tensor). Wall seconds: min/median/max "
          "over rounds of the slowest rank. CPU: seconds per rank (mean over ranks, median over "
          "rounds) without the cyclic GC's pauses, and rank 0's share (its CPU over the mean)")
    print(f"{'W':>3} {'model':<5} {'stall':>20} {'commit (2PC)':>20} {'save CPU':>8} "
          f"{'r0x':>5} {'restore':>20} {'rest. CPU':>9} {'r0x':>5} {'index KB':>8} "
          f"{'parts KB':>8} {'read/rank KB':>12} {'manif B':>7} {'plan rx KB':>10}")
    for w, res in results.items():
        if w in ("synthetic", "objects", "reshard"):
            continue
        if isinstance(res, str):
            print(f"{w:>3} failed: {res.splitlines()[0]}")
            continue
        for mode, s in res["summary"].items():
            print(f"{w:>3} {mode:<5} {f(s, 'warm.stall_s'):>20} {f(s, 'warm.commit_s'):>20} "
                  f"{s['warm.cpu_nogc_mean_s'][1]:8.3f} {s['warm.rank0_share_nogc'][1]:5.2f} "
                  f"{f(s, 'restore_s'):>20} {s['restore.cpu_nogc_mean_s'][1]:9.3f} "
                  f"{s['restore.rank0_share_nogc'][1]:5.2f} {s['body_bytes'][1] / 1e3:8.1f} "
                  f"{s['parts_bytes'][1] / 1e3:8.1f} "
                  f"{s['restore.body_read_bytes_per_rank'][1] / 1e3:12.1f} "
                  f"{s['manifest_bytes'][1]:7.0f} {s['warm.plan_received_bytes'][1] / 1e3:10.1f}")
    print("\nthe store's requests (as S3 would answer them: a multipart upload or a ranged GET "
          "past 16 MiB counts each part), medians over rounds: objects written by a full "
          "snapshot (chunk objects, packs, the body's index and parts, manifest), its PUTs in "
          "all and on the busiest rank; a restore's GETs in all and on the busiest rank")
    print(f"{'W':>9} {'model':<5} {'objects':>8} {'chunks':>7} {'packs':>6} {'bodies':>6} "
          f"{'PUT':>7} {'PUT/rank':>8} {'restore GET':>11} {'GET/rank':>8} {'GET MB':>8} "
          f"{'rule':>5}")
    for w, res in results.items():
        if w in ("synthetic", "objects", "reshard") or isinstance(res, str):
            continue
        for mode, s in res["summary"].items():
            if "cold.objects" not in s:
                continue
            print(f"{w:>9} {mode:<5} {s['cold.objects'][1]:8.0f} "
                  f"{s['cold.objects.chunk'][1]:7.0f} {s['cold.objects.pack'][1]:6.0f} "
                  f"{s['cold.objects.body'][1]:6.0f} {s['cold.PUT'][1]:7.0f} "
                  f"{s['cold.PUT_max_rank'][1]:8.0f} {s['restore.GET'][1]:11.0f} "
                  f"{s['restore.GET_max_rank'][1]:8.0f} {s['restore.GET_bytes'][1] / 1e6:8.2f} "
                  f"{s['cold.objects.predicted'][1] if 'cold.objects.predicted' in s else '':>5}")


def synthetic(tensors: int, world: int, rows: int = 64, cols: int = 128) -> dict[str, Any]:
    """Rank 0's and one rank's per-shard work at a world size beyond this machine, in one
    process: ``tensors`` FSDP-sharded tensors over ``world`` ranks, one chunk per shard (what
    the reports, the body's index and parts and the plan hold; no chunk is written or read).
    The body is in parts (docs/format.md, body format 3): each rank encodes its part, rank 0
    decodes W reports and encodes the index, a restoring rank decodes the index and its own
    part. Times are CPU seconds (``time.process_time``); run it with Python's cyclic GC off
    (its pauses are reported by the torchrun runs). The plan is timed up to 4 M metas."""
    import torch

    from ciuic.distributed.messages import Plan, Report
    from ciuic.format import manifest as mf
    from ciuic.format.boxes import overlap
    from ciuic.format.descriptor import TensorDescriptor
    from ciuic.format.digest import digest
    from ciuic.format.parts import BodyPart, shards_by_path, with_shards
    from ciuic.format.shards import assemble, plan, shard_of
    from ciuic.format.stats import Stats
    from ciuic.format.tree import Leaf, walk_leaves

    clock = time.process_time
    stats = {"inf": 0, "max": "0.0312", "mean": "-1.2e-05", "min": "-0.0311", "nan": 0,
             "norm": "2.2546"}
    rng = {"python": {"$tuple": [3, {"$tuple": [2**31 + i for i in range(625)]}, None]}}
    nbytes = rows * cols * 4
    path = "optimizer/state/t{}/exp_avg".format
    out: dict[str, Any] = {"tensors": tensors, "world": world, "shards": tensors * world}

    def part_of(r: int) -> BodyPart:
        return BodyPart(r, {path(t): [shard_of([r * rows, 0], TensorDescriptor.from_json(
            {"dtype": "float32", "shape": [rows, cols], "nbytes": nbytes,
             "chunks": [[f"{(t * world + r):064x}", nbytes]], "stats": stats})).to_json()]
            for t in range(tensors)}, {"rng": rng})

    # every rank at each snapshot: its part of the body (its own shards, its RNG)
    mid = world // 2
    c0 = clock()
    encoded = part_of(mid).encode()
    out["rank.encode_part_s"] = clock() - c0
    out["part_bytes"] = len(encoded)
    reports = [json.dumps(Report(new=nbytes * tensors, part=(f"{r:064x}", len(encoded)))
                          .to_json()) for r in range(world)]
    out["report_bytes"] = len(reports[0])
    # rank 0: decode the gathered reports (a part's name each), the index, its digest
    c0 = clock()
    decoded = [Report.from_json(json.loads(x)) for x in reports]
    out["rank0.decode_reports_s"] = clock() - c0
    leaves = [Leaf(path(t), torch.empty(0, rows * world, cols), {},
                   shard=([rows * world, cols], [0, 0])) for t in range(tensors)]
    whole = Stats(rows * cols * world, 0, 0, 0.0, 5.08, -0.0311, 0.0312)
    c0 = clock()
    assemble(leaves, [], {path(t): (rows * cols * world, whole) for t in range(tensors)})
    out["rank0.assemble_s"] = clock() - c0
    states = {"optimizer": {"state": {f"t{t}": {"exp_avg": {"$tensor": leaf.descriptor}}
                                      for t, leaf in enumerate(leaves)}},
              "dist": {"layout": "dcp-fqn", "world_size": world,
                       "parts": [list(rep.part) for rep in decoded]}}
    del decoded
    c0 = clock()
    body = mf.encode_body(states, distributed=True, split=True)
    out["rank0.encode_body_s"] = clock() - c0
    c0 = clock()
    name = digest(body)
    out["digest_s"] = clock() - c0
    out["body_bytes"] = len(body)
    out["body_bytes_all_parts"] = len(body) + world * len(encoded)
    del states, leaves
    # every rank at restore: the index and its own part, its shards against its box
    c0 = clock()
    trees = mf.decode_body(body, "body", name)
    own = BodyPart.decode(encoded, "part", digest(encoded))
    out["rank.decode_body_s"] = clock() - c0
    out["rank.body_read_bytes"] = len(body) + len(encoded)
    c0 = clock()
    found = shards_by_path([own])
    descs = [TensorDescriptor.from_json(with_shards(d, found.get(p, [])), p) for p, kind, d
             in walk_leaves(trees["optimizer"], "optimizer") if kind == "tensor"]
    out["rank.descriptors_s"] = clock() - c0
    c0 = clock()
    box = [mid * rows, 0]
    hits = sum(1 for d in descs for sh in d.shards or ()
               if overlap(list(sh.offsets), list(sh.shape), box, [rows, cols]))
    out["rank.overlap_scan_s"] = clock() - c0
    assert hits == tensors, hits
    del trees, descs, body
    # a plan made anew (a layout changed; a restart on the same layout adopts the restored
    # snapshot's): the all_gather (W payloads of T metas), then the owners. Its W x T metas
    # do not fit this machine's memory past a few million (22 GB at 2,200 x 16,384).
    if tensors * world > 4_000_000:
        return out
    mine = Plan(3, 2, metas=[{"path": f"optimizer/state/t{t}/exp_avg", "dtype": "float32",
                              "shape": [rows * world, cols], "offsets": [0, 0],
                              "local": [rows, cols], "nbytes": nbytes, "spread": True}
                             for t in range(tensors)], skeleton="0" * 64).to_json()
    payloads = []
    for r in range(world):
        for meta in mine["metas"]:
            meta["offsets"] = [r * rows, 0]
        payloads.append(json.dumps(mine, separators=(",", ":")))
    out["plan_payload_bytes"] = len(payloads[0])
    c0 = clock()
    plans = [Plan.from_json(json.loads(x)) for x in payloads]
    out["rank.plan_decode_s"] = clock() - c0
    c0 = clock()
    plan([x.metas for x in plans])
    out["rank.plan_owners_s"] = clock() - c0
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8, 16, 32])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--params", type=int, default=16, help="parameter tensors per model")
    p.add_argument("--kib", type=int, default=2048, help="state per rank, KiB")
    p.add_argument("--timeout", type=int, default=600, help="seconds per world size")
    p.add_argument("--synthetic", type=int, nargs="*", default=[], metavar="W",
                   help="also time rank 0's and a rank's per-shard work in one process, for "
                        "--synthetic-tensors sharded tensors over each of these world sizes")
    p.add_argument("--synthetic-tensors", type=int, default=2200)
    p.add_argument("--pack-bytes", type=int, nargs="+", default=[None], metavar="BYTES",
                   help="the pack_bytes knob (0: packs off), each world size run with each, "
                        "interleaved; default: the knob's own")
    p.add_argument("--objects", type=int, nargs="*", default=[], metavar="W",
                   help="also the objects and requests of Llama 3 70B's full snapshot and cold "
                        "restore at these world sizes, from the writer's rule "
                        "(bench/scale_objects.py), packs off and on")
    p.add_argument("--reshard", nargs="*", default=[], metavar="W:NEW",
                   help="also a restart of Llama 3 70B's FSDP2 state from W ranks onto NEW: "
                        "the box table's bytes, rank 0's and a restoring rank's CPU, the parts "
                        "a rank reads (bench/scale_objects.py)")
    p.add_argument("--chain", type=int, nargs="*", default=[], metavar="W",
                   help="a job restarted on each of these world sizes in turn, FSDP2 and "
                        "FSDP2 + TP (even sizes), every tensor checked (bench/reshard_worker.py)")
    p.add_argument("--chain-modes", nargs="+", default=["fsdp", "tp"], choices=["fsdp", "tp"])
    p.add_argument("--cold-ceph", type=int, default=0, metavar="W",
                   help="also a cold restart of W ranks from the Ceph cluster against boto3, "
                        "an object per rank (bench/cluster_ranks.py, 256 MiB, 3 rounds)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    results: dict[str, Any] = {}
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(),
               "python": platform.python_version(), "loadavg_before": os.getloadavg()}
    failed = False
    for j, n in enumerate(a.ranks):
        # each world size starts with the other setting than the last: interleaved
        for pb in a.pack_bytes if j % 2 == 0 else a.pack_bytes[::-1]:
            name = str(n) if pb is None else f"{n} p{pb >> 20}M" if pb >= 1 << 20 \
                else f"{n} p{pb}"
            t0 = time.perf_counter()
            res = one(n, a, pb)
            if isinstance(res, str):
                print(f"{name} ranks failed: {res}", file=sys.stderr)
                results[name] = res
                failed = True
                continue
            res["summary"] = summarize(res)
            res["loadavg_after"] = os.getloadavg()
            results[name] = res
            print(f"{name} ranks: {time.perf_counter() - t0:.0f} s, load average "
                  f"{res['loadavg_after'][0]:.1f}", file=sys.stderr)
        if failed:
            break  # a larger world will not do better
    table(results)
    if a.synthetic:
        import gc

        syn = []
        for w in a.synthetic:
            gc.collect()
            gc.disable()
            try:
                syn.append(synthetic(a.synthetic_tensors, w))
            finally:
                gc.enable()
        results["synthetic"] = syn
        print("one process, CPU s per shard (us): " + "; ".join(
            f"W={x['world']} ({x['shards']} shards, index {x['body_bytes'] / 1e6:.1f} MB, "
            f"a part {x['part_bytes'] / 1e6:.2f} MB): "
            + ", ".join(f"{k} {v / x['shards'] * 1e6:.1f}" for k, v in x.items()
                        if k.endswith("_s")) for x in syn))
    if a.objects:
        from ciuic import knobs

        k = knobs.get()
        results["objects"] = scale_objects.table(a.objects, k.chunk_bytes,
                                                 [0, k.pack_bytes or 4 * 1024 * 1024])
    if a.reshard:
        rows = [scale_objects.reshard(int(pair.split(":")[0]), int(pair.split(":")[1]))
                for pair in a.reshard]
        results["reshard"] = rows
        print("\na restart onto another world size (Llama 3 70B, FSDP2), one process: the box "
              "table, and what a restoring rank reads (the most of four spread ranks)")
        for r in rows:
            print(f"{r['world']:>6} -> {r['new_world']:<6} {r['classes']} classes, table "
                  f"{r['table_bytes'] / 1e6:.2f} MB, rank 0 builds it in "
                  f"{r['rank0_build_s']:.3f} s CPU, a rank finds its parts in "
                  f"{r['rank_find_s']:.3f} s and reads {r['parts_read']} parts "
                  f"(without the table: {r['parts_before']}); its first save plans by rule "
                  f"in {r['rank_plan_s']:.3f} s CPU ({r['plan_bytes'] / 1e6:.2f} MB received; "
                  f"every rank's metas: {r['plan_bytes_before'] / 1e9:.1f} GB); the plan's peak "
                  f"memory {r['rank_peak_bytes'] / 1e6:.0f} MB")
    if a.chain:
        results["chain"] = [chain(a.chain, mode, a.timeout) for mode in a.chain_modes]
        print("\na job restarted on another world size each run (FSDP2 / FSDP2 + TP, gloo): "
              "min / median / max over ranks")
        for c in results["chain"]:
            if "error" in c:
                print(f"{c['mode']}: FAILED: {c['error']}")
            for r in c["runs"]:
                restored = "" if "restore_s" not in r else (
                    f"restore {fmt(r['restore_s'])} s (CPU {fmt(r['restore_cpu_s'])}), parts "
                    f"{fmt(r['parts'], 0)} of {r['of']}, {r['compared']} tensors checked, "
                    f"{len(r['differ'])} differ; ")
                print(f"{c['mode']:>5} {r['world']:>3} ranks: {restored}save {fmt(r['save_s'])} "
                      f"s (CPU {fmt(r['save_cpu_s'])}), plans by rule "
                      f"{r['plans'][0] - r['plans'][1]} / {r['plans'][0]}, peak RSS "
                      f"{r['max_rss_mb']:.0f} MB")
    if a.cold_ceph:
        import cluster_ranks  # beside this file

        print("\na cold restart of every rank from the Ceph cluster (bench/cluster_ranks.py)")
        results["cold_ceph"] = cluster_ranks.main(["--ranks", str(a.cold_ceph)])
    if a.json:
        import torch

        machine["torch"] = torch.__version__
        a.json.write_text(json.dumps(rounded({"machine": machine, "args": vars(a) | {
            "json": str(a.json)}, "results": results}), separators=(",", ":")))
    return results


if __name__ == "__main__":
    main()
