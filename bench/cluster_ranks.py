"""A cold restart of every rank from the Ceph cluster (issue #45, item 4): ciuic against the same
bytes as one object per rank with boto3 (what DCP writes: a file per rank), FSDP2; with
``--dcp``, against DCP's own save and load through its fsspec storage on s3fs too.

    .venv/bin/python bench/cluster_ranks.py [--ranks 4] [--mib 256] [--rounds 3] [--dcp]
        [--json FILE]

Starts the test cluster of tests/cluster.py (3 BlueStore OSDs, 3 replicas, radosgw), then two
torchrun launches of ``bench/cluster_ranks_worker.py`` (gloo, CPU): one saves the job's state
each round (ciuic's ``save()``, boto3's upload of each rank's bytes), a second, new processes,
restores it (ciuic's ``restore()``, boto3's download of each rank's object into its shards),
every rank in parallel, rounds interleaved. Printed: the slowest rank's wall time (min / median
/ max over rounds), the CPU time of all ranks together (user and system), the ratio of the
medians, and what a round asked of the cluster: the S3 requests of all ranks by operation and
the RADOS objects its buckets hold.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import cluster  # noqa: E402

WORKER = Path(__file__).with_name("cluster_ranks_worker.py")
#: s3fs for ``--dcp``, in a folder of its own: its aiobotocore pins an older botocore than the
#: development environment's boto3 (every system of such a run uses that botocore)
S3FS = ROOT / ".venv" / "dcp-s3fs"
S3FS_INSTALL = f".venv/bin/python -m pip install --target {S3FS.relative_to(ROOT)} s3fs boto3"


def rados_objects(cl: cluster.Cluster, bucket: str) -> int:
    """The RADOS objects that hold a bucket's S3 objects (radosgw stripes an object into a head
    and 4 MiB tails, a multipart upload into its parts), in the data pool."""
    stats = json.loads(subprocess.run(
        ["radosgw-admin", "-c", str(cl.conf), "bucket", "stats", "--bucket", bucket],
        capture_output=True, text=True, timeout=60, check=True).stdout)
    listed = subprocess.run(["rados", "-c", str(cl.conf), "-p", "default.rgw.buckets.data",
                             "ls"], capture_output=True, text=True, timeout=120, check=True)
    return sum(1 for name in listed.stdout.split() if name.startswith(stats["marker"] + "_"))


def launch(phase: str, a: argparse.Namespace, cl: cluster.Cluster, out: Path,
           buckets: dict[str, list[str]]) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={a.ranks}", str(WORKER), "--phase", phase, "--endpoint",
           cl.endpoint, "--mib", str(a.mib), "--out", str(out),
           "--ciuic", *buckets["ciuic"], "--boto3", *buckets["boto3"],
           *(["--dcp", *buckets["dcp"]] if "dcp" in buckets else []),
           *(["--also", a.also] if a.also else [])]
    env = {**os.environ, **cl.env, "OMP_NUM_THREADS": "1"}
    if "dcp" in buckets:  # every system then runs on s3fs's botocore, not only DCP
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(S3FS), env.get("PYTHONPATH"))))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{phase} failed (exit {run.returncode}):\n{run.stderr[-5000:]}")
    return [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in range(a.ranks)]


def mmm(xs: list[float]) -> list[float]:
    return [min(xs), statistics.median(xs), max(xs)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=int, default=256, help="the job's state, MiB in all")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--also", default=None, metavar="KNOB=VALUE",
                   help="restore ciuic a second time each round with this knob (an A/B in one "
                        "run), e.g. read_ahead_bytes=0")
    p.add_argument("--dcp", action="store_true",
                   help="DCP's own save and load too, through its fsspec storage on s3fs "
                        f"(installed once with `{S3FS_INSTALL}`)")
    a = p.parse_args(argv)
    if a.dcp and not (S3FS / "s3fs").is_dir():
        p.error(f"--dcp needs s3fs in {S3FS}: install it with `{S3FS_INSTALL}`")
    results: dict[str, Any] = {"ranks": a.ranks, "mib": a.mib, "rounds": a.rounds}
    with tempfile.TemporaryDirectory() as tmp0, \
            cluster.running(block_bytes=max(8 << 30, 8 * a.mib * 2**20 * a.rounds)) as cl:
        warm = cl.make_bucket()  # radosgw creates its data pool at the first object written
        cl.client().put_object(Bucket=warm, Key="warm-up", Body=b"x")  # type: ignore[attr-defined]
        buckets = {s: [cl.make_bucket() for _ in range(a.rounds)]
                   for s in ("ciuic", "boto3", *(["dcp"] if a.dcp else []))}
        loads = [os.getloadavg()[0]]
        out = Path(os.environ.get("BENCH_OUT", tmp0))
        saved = launch("save", a, cl, out, buckets)
        loads.append(os.getloadavg()[0])
        restored = launch("restore", a, cl, out, buckets)
        loads.append(os.getloadavg()[0])
        rados = {s: rados_objects(cl, buckets[s][0]) for s in buckets}
        started = cl.started_s
    for phase, ranks in (("save", saved), ("restore", restored)):
        for system in ranks[0]["times"]:
            slowest = [max(r["times"][system][i] for r in ranks) for i in range(a.rounds)]
            requests: dict[str, int] = {}
            for r in ranks:
                for op, n in r["requests"][system].items():
                    requests[op] = requests.get(op, 0) + n
            cpu = [sum(r["cpu"][system][i] for r in ranks) for i in range(a.rounds)]
            results[f"{phase} {system}"] = {"s": mmm(slowest), "cpu_s": mmm(cpu),
                                            "requests": requests}
    results["rados_objects"] = rados
    results["bytes"] = sum(r["bytes"] for r in saved)
    for phase in ("save", "restore"):
        results[f"{phase} ratio"] = (results[f"{phase} ciuic"]["s"][1]
                                     / results[f"{phase} boto3"]["s"][1])
        if a.dcp:
            results[f"{phase} ratio dcp"] = (results[f"{phase} ciuic"]["s"][1]
                                             / results[f"{phase} dcp"]["s"][1])
    results["machine"] = {"cpus": os.cpu_count(), "machine": platform.machine(),
                          "load_1min": loads, "cluster_start_s": started}
    print(f"{a.ranks} ranks (FSDP2, gloo), {results['bytes'] / 2**20:.0f} MiB of state, "
          f"{a.rounds} rounds; Ceph (3 OSDs, 3 replicas) on this machine, "
          f"{os.cpu_count()} CPUs, load {min(loads):.1f}-{max(loads):.1f}")
    for phase, ranks in (("save", saved), ("restore", restored)):
        for system in ranks[0]["times"]:
            r = results[f"{phase} {system}"]
            s = " / ".join(f"{x:.2f}" for x in r["s"])
            ops = ", ".join(f"{op} {n}" for op, n in sorted(r["requests"].items()))
            cpu = " / ".join(f"{x:.2f}" for x in r["cpu_s"])
            print(f"{phase:8} {system:6} {s} s  (the slowest rank), CPU {cpu} s (all ranks)"
                  f"  requests: {ops}")
        print(f"{phase:8} ciuic / boto3 (medians): {results[f'{phase} ratio']:.2f}x")
        if a.dcp:
            print(f"{phase:8} ciuic / DCP (medians): {results[f'{phase} ratio dcp']:.2f}x")
        for system in [s for s in ranks[0]["times"] if s not in ("ciuic", "boto3", "dcp")]:
            ratio = results[f"{phase} {system}"]["s"][1] / results[f"{phase} boto3"]["s"][1]
            results[f"{phase} ratio {system}"] = ratio
            print(f"{phase:8} {system} / boto3 (medians): {ratio:.2f}x")
    print("RADOS objects a round's buckets hold: "
          + ", ".join(f"{s} {n}" for s, n in rados.items()))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
