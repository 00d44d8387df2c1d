"""Objects and requests of a full snapshot and a cold restore at world sizes beyond this machine
(issue #45, items 5 and 6), from the writer's placement rule: ``bench/scale.py --objects``.

Every rank holds its FSDP2 shard of each sharded tensor (dim 0 cut as ``torch.chunk`` cuts it:
``ceil(rows / W)`` rows a rank, the last ranks fewer or none). The writer (chain/writer.py,
chain/chunkwriter.py) stores a shard of at most ``inline_max_bytes`` inline in the rank's part
of the body, cuts a larger one into pieces of ``chunk_bytes`` (the last one shorter), writes
each whole chunk as an object of its own, and, with packs on, places each shorter piece into
the rank's open pack (closed once it holds ``pack_bytes``); with packs off, each shorter piece
is an object too. Each rank then writes its part of the body; rank 0 the index and the
manifest. A restore on the same layout reads the index, its part, each of its chunk objects,
and its packs in runs of at most ``RUN_MAX_BYTES`` (chain/packreads.py).

The same rule is checked against the torchrun runs of ``bench/scale.py`` (measured objects at
2 to 32 ranks; the table prints both). The model is Llama 3 70B's parameter shapes (hidden
8,192, 80 layers, 64 query and 8 key/value heads of 128, MLP 28,672, vocabulary 128,256) in
fp32 with Adam's two moments: 723 parameters, T_s = 2,169 sharded tensors, 0.85 TB.
"""

from __future__ import annotations

import math
from typing import Any

#: S3's list prices (us-east-1, Standard): per 1,000 PUT/LIST requests, per 1,000 GETs
PUT_USD_PER_1000 = 0.005
GET_USD_PER_1000 = 0.0004
#: S3: an object above this is a multipart upload (its start, its parts, its end), read back as
#: ranged GETs of a part each (knobs s3_multipart_threshold_bytes, s3_part_bytes)
S3_THRESHOLD = 16 * 1024 * 1024
S3_PART = 8 * 1024 * 1024


def llama3_70b() -> list[tuple[int, int]]:
    """Each parameter's (rows, columns) (a vector is (n, 1))."""
    h, kv, mlp, vocab, layers = 8192, 8 * 128, 28672, 128256, 80
    per_layer = [(h, h), (kv, h), (kv, h), (h, h),  # q, k, v, o
                 (mlp, h), (mlp, h), (h, mlp),  # gate, up, down
                 (h, 1), (h, 1)]  # the two norms
    return [(vocab, h)] + per_layer * layers + [(h, 1), (vocab, h)]


def s3_requests(nbytes: int) -> int:
    """Requests of one PUT, or one ranged GET, of ``nbytes`` on S3."""
    return 1 if nbytes <= S3_THRESHOLD else math.ceil(nbytes / S3_PART) + 2


def rank_objects(params: list[tuple[int, int]], world: int, rank: int, *, chunk: int,
                 pack: int, inline: int, itemsize: int = 4, copies: int = 3,
                 run_max: int = 16 * 1024 * 1024, header: int = 16) -> dict[str, int]:
    """One rank's objects and requests at a full snapshot and at a restore on the same layout:
    ``copies`` tensors of each parameter's shape (the weight and Adam's two moments)."""
    chunks = small = packs = 0
    put = get = 0
    open_pack = 0  # bytes in the rank's open pack
    for rows, cols in params:
        per = -(-rows // world)
        mine = max(0, min(per, rows - rank * per))
        n = mine * cols * itemsize
        for _ in range(copies):
            if n <= inline:
                continue  # in the rank's part of the body
            whole, rest = divmod(n, chunk)
            chunks += whole
            put += whole * s3_requests(chunk)
            get += whole * s3_requests(chunk)
            if not rest:
                continue
            if pack <= 0:
                small += 1
                put += 1
                get += 1
                continue
            open_pack += rest + header
            if open_pack >= pack:
                packs += 1
                put += s3_requests(open_pack)
                get += math.ceil(open_pack / run_max)
                open_pack = 0
    if open_pack:
        packs += 1
        put += s3_requests(open_pack)
        get += math.ceil(open_pack / run_max)
    return {"chunks": chunks, "small": small, "packs": packs, "objects": chunks + small + packs,
            "put": put, "get": get}


def snapshot_objects(params: list[tuple[int, int]], world: int, *, chunk: int, pack: int,
                     inline: int = 256, sample: int = 64) -> dict[str, Any]:
    """A full snapshot's objects and requests over every rank (``sample`` ranks spread over the
    world computed, the rest taken as their nearest sampled neighbour's: the shards of ranks
    in one stretch are equal), and a restore's, at ``world`` ranks."""
    picks = sorted({round(i * (world - 1) / max(1, sample - 1)) for i in range(sample)})
    per = {r: rank_objects(params, world, r, chunk=chunk, pack=pack, inline=inline)
           for r in picks}
    total: dict[str, float] = {}
    for i, r in enumerate(picks):  # rank r stands for the ranks up to the next sample
        upto = picks[i + 1] if i + 1 < len(picks) else world
        for k, v in per[r].items():
            total[k] = total.get(k, 0) + v * (upto - r)
    state = sum(rows * cols for rows, cols in params) * 4 * 3
    bodies = world + 2  # every rank's part, the index, the box table (the manifest beside them)
    objects = total["objects"] + bodies + 1
    put = total["put"] + bodies + 1
    get = total["get"] + 2 * world + world  # each rank: the manifest, the index, its part
    return {"world": world, "pack_bytes": pack, "state_bytes": state,
            "objects": objects, "chunk_objects": total["chunks"] + total["small"],
            "packs": total["packs"], "bound": 2 * world + state / chunk + 2,
            "put": put, "get": get, "put_usd": put / 1000 * PUT_USD_PER_1000,
            "get_usd": get / 1000 * GET_USD_PER_1000,
            "objects_per_rank_max": max(v["objects"] for v in per.values()) + 1,
            "get_per_rank_max": max(v["get"] for v in per.values()) + 3,
            "mean_object_bytes": state / max(1, total["objects"])}


def table(worlds: list[int], chunk: int, packs: list[int]) -> list[dict[str, Any]]:
    params = llama3_70b()
    rows = [snapshot_objects(params, w, chunk=chunk, pack=p) for w in worlds for p in packs]
    print(f"\nLlama 3 70B, fp32 + Adam ({rows[0]['state_bytes'] / 1e12:.2f} TB), FSDP2 over W "
          f"ranks, chunks of {chunk >> 20} MiB: a full snapshot's objects and S3 requests, and "
          "a cold restore's GETs (every rank, the same layout)")
    print(f"{'W':>6} {'packs':>7} {'objects':>11} {'bound':>11} {'largest/rank':>12} "
          f"{'mean obj KB':>11} {'PUTs':>11} {'$ PUT':>8} {'GETs':>11} {'GET/rank':>8}")
    for r in rows:
        print(f"{r['world']:>6} {r['pack_bytes'] >> 20 if r['pack_bytes'] else 'off':>7} "
              f"{r['objects']:>11,.0f} {r['bound']:>11,.0f} {r['objects_per_rank_max']:>12,} "
              f"{r['mean_object_bytes'] / 1e3:>11,.1f} {r['put']:>11,.0f} "
              f"{r['put_usd']:>8.2f} {r['get']:>11,.0f} {r['get_per_rank_max']:>8,}")
    return rows


def reshard(world: int, new_world: int, params: list[tuple[int, int]] | None = None
            ) -> dict[str, Any]:
    """A restart of Llama 3 70B's FSDP2 state from ``world`` ranks onto ``new_world``, in one
    process: rank 0's box table (format/boxes.py) built from every rank's report, encoded,
    then decoded by restoring ranks (four spread over the new world), each finding the parts
    its boxes need. CPU seconds (``time.process_time``; the most of the four), bytes, and the
    most parts one of them reads, against every one of them before the table."""
    import time
    import tracemalloc

    from ciuic.distributed.plan import ruled_plan
    from ciuic.format.boxes import BoxTable
    from ciuic.format.digest import digest

    params = params or llama3_70b()
    shapes = sorted(set(params))
    paths: dict[str, list[str]] = {}
    for i, shape in enumerate(params):  # a class per shape: FSDP2 cuts every one along rows
        for t in ("w", "exp_avg", "exp_avg_sq"):
            paths.setdefault(f"c{shapes.index(shape)}", []).append(f"p{i}/{t}")

    def box(rows: int, cols: int, r: int, w: int) -> tuple[list[int], list[int]]:
        per = -(-rows // w)
        lo = min(rows, r * per)
        return [lo, 0], [max(0, min(per, rows - lo)), cols]

    clock = time.process_time
    held = [(r, [(f"c{i}", *box(rows, cols, r, world)) for i, (rows, cols) in enumerate(shapes)
                 if box(rows, cols, r, world)[1][0] > 0]) for r in range(world)]
    c0 = clock()
    table = BoxTable.build(paths, held)
    data = table.encode()
    name = digest(data)
    built = clock() - c0
    found, parts = 0.0, 0
    for rank in sorted({0, new_world // 3, new_world // 2 + 1, new_world - 1}):
        c0 = clock()
        read = BoxTable.decode(data, "table", name)
        wanted = {p: box(rows, cols, rank, new_world) for i, (rows, cols) in enumerate(params)
                  for p in (f"p{i}/w", f"p{i}/exp_avg", f"p{i}/exp_avg_sq")
                  if box(rows, cols, rank, new_world)[1][0] > 0}
        ranks = read.ranks_for(wanted)
        found = max(found, clock() - c0)
        assert ranks is not None
        parts = max(parts, len(ranks | {0, rank % world}))  # and rank 0's, its own r % W
    # the memory of a restoring rank's plan: the table decoded and searched, its captured
    # leaves and their owners by rule (Python's heap, traced apart from the timings above)
    tracemalloc.start()
    read = BoxTable.decode(data, "table", name)
    wanted = {p: box(rows, cols, 1, new_world) for i, (rows, cols) in enumerate(params)
              for p in (f"p{i}/w", f"p{i}/exp_avg", f"p{i}/exp_avg_sq")}
    read.ranks_for(wanted)
    ruled_plan(_captured(params, shapes, 1, new_world, box), 1, new_world)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del read
    planned, owners = 0.0, 0
    for rank in sorted({0, new_world // 2 + 1, new_world - 1}):
        captured = _captured(params, shapes, rank, new_world, box)
        c0 = clock()
        ruled = ruled_plan(captured, rank, new_world)
        planned = max(planned, clock() - c0)
        assert ruled is not None
        owners = max(owners, sum(o == rank for o in ruled[1].values()))
    tensors = len(captured.global_leaves)
    return {"world": world, "new_world": new_world, "classes": len(table.classes),
            "table_bytes": len(data), "rank0_build_s": built, "rank_find_s": found,
            "parts_read": parts, "parts_before": world,
            # the first save on the new layout: owners by rule (a 64-hex-digit vote from each
            # rank) against every rank's metas (128 B a global tensor, docs/multinode.md)
            "rank_plan_s": planned, "rank_peak_bytes": peak, "rank_writes": owners,
            "plan_bytes": 66 * new_world, "plan_bytes_before": META_BYTES * tensors * new_world}


#: what one global tensor's meta costs in the plan exchange (docs/multinode.md, "The model")
META_BYTES = 128


def _captured(params: list[tuple[int, int]], shapes: list[tuple[int, int]], rank: int,
              world: int, box: Any) -> Any:
    """A restoring rank's capture on the new layout, as capture_dist makes it: its FSDP2 box of
    each sharded tensor (weights, Adam's moments; a layout class per shape, the only holder of
    its box) and each parameter's replicated Adam step, on the meta device (no bytes)."""
    import torch

    from ciuic.distributed.plan import DistCaptured
    from ciuic.format.tree import Leaf

    leaves = []
    for i, (rows, cols) in enumerate(params):
        offsets, local = box(rows, cols, rank, world)
        for t in ("w", "exp_avg", "exp_avg_sq"):
            leaves.append(Leaf(f"p{i}/{t}", torch.empty(local, device="meta"), {},
                               ([rows, cols], offsets),
                               sharding=f"c{shapes.index((rows, cols))}", holders=(rank,)))
        leaves.append(Leaf(f"p{i}/step", torch.empty((), device="meta"), {}))
    return DistCaptured(states={}, leaves=leaves, global_leaves=leaves,
                        spread={leaf.path for leaf in leaves})
