"""S3 benchmark: a ciuic snapshot uploaded to an S3 server, against boto3's own ``upload_file``
of the same bytes to the same server, and the bytes dedup saves on the next snapshot.

    .venv/bin/python bench/s3.py [--rounds 3] [--scale 2] [--endpoint URL] [--json FILE]
    .venv/bin/python bench/s3.py --state small --rtt-ms 10 [--rounds 5]

Without ``--endpoint`` it starts moto's standalone server on 127.0.0.1 (what this machine's
registries offer; with real S3 or MinIO pass ``--endpoint`` and set the AWS credentials). Each
round uses fresh buckets; the systems are interleaved round by round. ciuic's figure is the time
until ``save()`` returns (committed: every object acknowledged by the server); boto3's is
``upload_file`` of one file holding the same tensor bytes (multipart, 10 threads, its defaults),
the file already in the page cache. Prints min/median/max.

``--state small`` snapshots the demo's model and AdamW state instead (87 tensors, 4.8 MiB: a
snapshot of many small chunks, which ciuic writes in batches). ``--rtt-ms`` puts a proxy in
front of the server that delays each request by a network round trip (bench/latency.py), for
both systems: moto on 127.0.0.1 answers in well under a millisecond, real S3 in 10-30 ms, and a
client that sends its requests one after another pays that per request.
"""

from __future__ import annotations

import argparse
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

from bench.latency import latency_proxy  # noqa: E402
from bench.run import nbytes, reference_state  # noqa: E402
from tests.s3server import client, free_port, make_bucket, start_moto  # noqa: E402

from ciuic import SnapshotManager, StateHolder, knobs  # noqa: E402


def summary(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def fmt(xs: list[float], unit: str = "s") -> str:
    s = summary(xs)
    return f"{s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f} {unit}"


def boto3_upload(endpoint: str, path: Path) -> float:
    bucket = make_bucket(endpoint)
    c = client(endpoint)
    t0 = time.perf_counter()
    c.upload_file(str(path), bucket, "state.bin")
    return time.perf_counter() - t0


def ciuic_snapshots(endpoint: str, state: dict[str, torch.Tensor], threads: int,
                    compression: str) -> tuple[float, float, int, int]:
    """(full seconds, incremental seconds, full bytes sent, incremental bytes sent)."""
    url = f"s3://{make_bucket(endpoint)}/bench?endpoint={endpoint}"
    holder = StateHolder(state)
    with knobs.override(write_threads=threads), tempfile.TemporaryDirectory() as home:
        os.environ["XDG_CACHE_HOME"] = home
        m = SnapshotManager("bench", store=url, asynchronous=False, handle_signals=False,
                            compression=compression)
        t0 = time.perf_counter()
        full = m.save(1, state=holder)
        t_full = time.perf_counter() - t0
        names = sorted(state)
        for name in names[:: 10]:  # 10 % of the tensors change
            state[name].add_(1e-3)
        t0 = time.perf_counter()
        inc = m.save(2, state=holder)
        t_inc = time.perf_counter() - t0
        for name in names[:: 10]:
            state[name].sub_(1e-3)
        m.close()
    return t_full, t_inc, full.new_bytes, inc.new_bytes


def small_state() -> dict[str, torch.Tensor]:
    """The demo's model and AdamW state after one step, as one flat dict of its tensors."""
    from ciuic.demo.model import CharGPT, GPTConfig

    torch.manual_seed(0)
    model = CharGPT(GPTConfig(vocab_size=65))
    opt = torch.optim.AdamW(model.parameters())
    idx = torch.zeros(2, 8, dtype=torch.long)
    _, loss = model(idx, idx)
    assert loss is not None
    loss.backward()
    opt.step()
    state = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        state |= {f"adam.{i}.{k}": v.clone() for k, v in st.items() if v.dim()}
    return state


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scale", type=int, default=2, help="1 = the 1 GiB reference state")
    p.add_argument("--endpoint", default=None)
    p.add_argument("--threads", type=int, nargs="+", default=[4, 16],
                   help="ciuic writer threads to measure")
    p.add_argument("--compression", nargs="+", default=["auto", "off"],
                   help="ciuic compression modes to measure (auto compresses on S3)")
    p.add_argument("--state", choices=["reference", "small"], default="reference",
                   help="the 1 GiB reference state (at --scale), or the demo's small tensors")
    p.add_argument("--rtt-ms", type=float, default=0.0,
                   help="a network round trip added to each request (bench/latency.py)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    logging.getLogger("ciuic").setLevel(logging.ERROR)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    state = reference_state(args.scale) if args.state == "reference" else small_state()
    size = nbytes(state)
    with tempfile.TemporaryDirectory() as tmp:
        blob = Path(tmp) / "state.bin"
        with blob.open("wb") as f:
            for t in state.values():
                f.write(t.numpy().tobytes())
        if args.endpoint:
            return run(args, args.endpoint, state, size, blob)
        with start_moto(Path(tmp) / "moto.log") as moto, \
                latency_proxy(moto, args.rtt_ms, free_port()) as endpoint:
            return run(args, endpoint, state, size, blob)


def run(args: argparse.Namespace, endpoint: str, state: dict[str, torch.Tensor], size: int,
        blob: Path) -> dict[str, Any]:
    times: dict[str, list[float]] = {"boto3.upload_file": []}
    inc: dict[str, list[float]] = {}
    sent: dict[str, tuple[int, int]] = {}
    for _ in range(args.rounds):
        times["boto3.upload_file"].append(boto3_upload(endpoint, blob))
        for threads, compression in [(t, c) for t in args.threads for c in args.compression]:
            name = f"ciuic {threads}t compr={compression}"
            t_full, t_inc, full_bytes, inc_bytes = ciuic_snapshots(endpoint, state, threads,
                                                                   compression)
            times.setdefault(name, []).append(t_full)
            inc.setdefault(name, []).append(t_inc)
            sent[name] = (full_bytes, inc_bytes)
    base = statistics.median(times["boto3.upload_file"])
    print(f"state {size / 2**20:.1f} MiB in {len(state)} tensors, {args.rounds} round(s), "
          f"endpoint {endpoint} (+{args.rtt_ms:g} ms per request), "
          f"{platform.machine()} {os.cpu_count()} CPUs")
    print(f"{'system':24} {'upload s (min / median / max)':32} {'MB/s':>7} {'vs boto3':>9}")
    results: dict[str, Any] = {"state_bytes": size, "tensors": len(state), "rounds": args.rounds,
                               "rtt_ms": args.rtt_ms, "systems": {}}
    for name, xs in times.items():
        med = statistics.median(xs)
        throughput = size / med / 1e6
        print(f"{name:24} {fmt(xs):32} {throughput:7.0f} {base / med:8.2f}x")
        entry: dict[str, Any] = {"upload_s": summary(xs), "throughput_vs_boto3": base / med}
        if name in inc:
            full_bytes, inc_bytes = sent[name]
            entry |= {"incremental_s": summary(inc[name]), "full_bytes": full_bytes,
                      "incremental_bytes": inc_bytes}
            print(f"{'':24} incremental (10 % changed): {fmt(inc[name])}, sent "
                  f"{inc_bytes / 2**20:.1f} MiB of {size / 2**20:.0f} MiB "
                  f"({100 * inc_bytes / size:.1f} %), dedup saved "
                  f"{100 - 100 * inc_bytes / size:.1f} %")
        results["systems"][name] = entry
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
