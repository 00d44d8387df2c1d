"""The 1 GiB reference state to a real Ceph cluster and back (issue 34, item 4): ciuic against
boto3's own transfer of the same bytes as one object, and an incremental snapshot.

    .venv/bin/python bench/cluster.py [--rounds 3] [--scale 1] [--chunk-bytes B] [--json FILE]

Starts the test cluster of tests/cluster.py (1 monitor, 1 manager, 3 BlueStore OSDs on sparse
files, radosgw; pools of 3 replicas, min_size 2; Debian's Ceph, scripts/services.sh) on
127.0.0.1, with OSD files large enough for the rounds. Each round, interleaved, each system in
a fresh bucket:

- boto3: ``upload_file`` of one file holding the state's tensor bytes, then ``download_file``
  of it, both with ``TransferConfig``'s defaults (multipart above 8 MiB, 10 threads); the file
  is in the page cache.
- ciuic: a synchronous ``save()`` of the state (until it is committed: every object
  acknowledged by radosgw, so on ``min_size`` OSDs), an incremental one with 10 % of the
  tensors changed, and a ``restore()`` by a new manager into new tensors (every chunk's digest
  checked), compared with the state.

Prints min / median / max of each and the throughput; the load of the machine (other suites
share its cores) is printed beside them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.run import nbytes, reference_state  # noqa: E402
from tests import cluster  # noqa: E402

from ciuic import SnapshotManager, StateHolder, knobs  # noqa: E402


def summary(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def fmt(xs: list[float]) -> str:
    s = summary(xs)
    return f"{s['min']:6.2f} / {s['median']:6.2f} / {s['max']:6.2f} s"


def empty(cl: cluster.Cluster, bucket: str) -> None:
    """Delete a bucket's objects (radosgw frees their space in its garbage collection)."""
    c: Any = cl.client()
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            c.delete_objects(Bucket=bucket, Delete={"Objects": keys})


class Meter:
    """Wall time, and CPU seconds of this process and of the cluster's daemons, of each phase."""

    def __init__(self, cl: cluster.Cluster) -> None:
        self.cl = cl
        self.wall: dict[str, list[float]] = {}
        self.cpu: dict[str, list[tuple[float, float]]] = {}  # (client, cluster)

    def __call__(self, name: str, fn: Any) -> Any:
        c0, k0, t0 = _own_cpu(), self.cl.cpu_s(), time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
        self.wall.setdefault(name, []).append(wall)
        self.cpu.setdefault(name, []).append((_own_cpu() - c0, self.cl.cpu_s() - k0))
        return out


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def boto3_round(m: Meter, blob: Path, back: Path) -> None:
    cl = m.cl
    c: Any = cl.client()
    bucket = cl.make_bucket()
    m("boto3 upload_file", lambda: c.upload_file(str(blob), bucket, "state.bin"))
    m("boto3 download_file", lambda: c.download_file(bucket, "state.bin", str(back)))
    assert back.stat().st_size == blob.stat().st_size
    back.unlink()
    empty(cl, bucket)


def ciuic_round(m: Meter, state: dict[str, torch.Tensor], compression: str) -> int:
    """A full save, an incremental one, a restore; returns the incremental bytes sent."""
    cl = m.cl
    bucket = cl.make_bucket()
    url = cl.url(bucket, "bench")
    tag = f"ciuic compression={compression}"
    with tempfile.TemporaryDirectory() as home:
        os.environ["XDG_CACHE_HOME"] = home
        w = SnapshotManager("bench", store=url, asynchronous=False, handle_signals=False,
                            compression=compression)
        m(f"{tag}: save (full)", lambda: w.save(1, state=StateHolder(state)))
        names = sorted(state)
        for name in names[::10]:  # 10 % of the tensors change
            state[name].add_(1e-3)
        inc = m(f"{tag}: save (10 % changed)", lambda: w.save(2, state=StateHolder(state)))
        w.close()
        back = StateHolder()
        r = SnapshotManager("bench", store=url, handle_signals=False)
        assert m(f"{tag}: restore", lambda: r.restore(state=back)) == 2
        r.close()
        assert all(torch.equal(back.state[k], v) for k, v in state.items()), "restore differs"
        for name in names[::10]:
            state[name].sub_(1e-3)
    empty(cl, bucket)
    return int(inc.new_bytes)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=int, default=1, help="1 = the 1 GiB reference state")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--chunk-bytes", type=int, default=None,
                   help="ciuic's chunk size (the knob; default its own): 4190208 keeps a "
                        "chunk object with its frame within radosgw's 4 MiB head")
    p.add_argument("--compression", nargs="+", default=["auto", "off"],
                   help="ciuic's compression modes to measure (auto compresses on S3)")
    a = p.parse_args(argv)
    with (knobs.override(chunk_bytes=a.chunk_bytes) if a.chunk_bytes is not None
          else contextlib.nullcontext()):
        return measure(a)


def measure(a: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("ciuic").setLevel(logging.ERROR)
    state = reference_state(a.scale)
    size = nbytes(state)
    loads: list[float] = []
    inc_bytes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp, \
            cluster.running(block_bytes=max(8 << 30, 4 * size * a.rounds)) as cl:
        os.environ.update(cl.env)
        blob, back = Path(tmp) / "state.bin", Path(tmp) / "back.bin"
        with blob.open("wb") as f:
            for t in state.values():
                f.write(t.numpy().tobytes())
        started, memory = cl.started_s, cl.rss_bytes()
        warm = cl.make_bucket()  # radosgw creates its data pool at the first object written
        cl.client().put_object(Bucket=warm, Key="warm-up", Body=b"x")  # type: ignore[attr-defined]
        m = Meter(cl)
        for _ in range(a.rounds):
            loads.append(os.getloadavg()[0])
            boto3_round(m, blob, back)
            for compression in a.compression:
                inc_bytes[compression] = ciuic_round(m, state, compression)
    print(f"state {size / 2**20:.0f} MiB in {len(state)} tensors, {a.rounds} rounds, Ceph "
          f"(3 OSDs, 3 replicas) up in {started:.1f} s, {memory / 2**20:.0f} MiB resident; "
          f"{platform.machine()} {os.cpu_count()} CPUs, load {min(loads):.1f}-{max(loads):.1f}")
    print(f"{'':44} {'min / median / max':24} {'MB/s':>6}  CPU s: client, cluster (medians)")
    out: dict[str, Any] = {"state_bytes": size, "tensors": len(state), "rounds": a.rounds,
                           "chunk_bytes": knobs.get().chunk_bytes,
                           "cluster_start_s": started, "cluster_rss_bytes": memory,
                           "load_1min": loads, "incremental_bytes": inc_bytes, "systems": {}}
    for name, xs in m.wall.items():
        mbs = size / statistics.median(xs) / 1e6
        client = statistics.median(c for c, _ in m.cpu[name])
        daemons = statistics.median(k for _, k in m.cpu[name])
        print(f"{name:44} {fmt(xs)}  {mbs:6.0f}  {client:6.1f} {daemons:6.1f}")
        out["systems"][name] = {**summary(xs), "mb_per_s_of_the_state": mbs,
                                "client_cpu_s": client, "cluster_cpu_s": daemons}
    for compression, n in inc_bytes.items():
        print(f"compression={compression}: the incremental snapshot sent {n / 2**20:.0f} MiB "
              f"of {size / 2**20:.0f} MiB")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
