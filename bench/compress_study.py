"""Compression study: ciuic.floatcodec against plain zstd, on one 4 MiB chunk, one core.

    .venv/bin/python bench/compress_study.py [--reps 15] [--mib 4] [--json out.json]

For each kind of data (normal(0, 0.02) weights in fp32, bf16 and fp16; Adam moments in fp32,
both as the reference state of bench/run.py builds them and simulated from squared gradients;
and an fp32 chunk of which 1 % of the values changed since the previous snapshot, for the XOR
delta) and each codec, prints the ratio (compressed / raw bytes; 1.000 when the codec declines
and the chunk would be stored raw) and the single-thread encode and decode throughput in GB/s
(raw bytes / seconds, 1 GB = 1e9 bytes) as min / median / max over ``--reps`` repetitions.
Every result is checked for a bit-exact round trip.

Codecs: ``floatcodec`` (this package's codec), ``zstd-1`` (zstd level 1 on the whole chunk),
``zstd-1-top`` (byte planes, zstd level 1 on the top plane, others raw: the idea measured in
docs/benchmarks.md) and ``zstd-fast-top`` (the same with floatcodec's zstd parameters, without
its nibble code), plus ``blosc2-*`` when python-blosc2 is installed (byte shuffle + zstd level 1,
and bit shuffle + lz4, ``nthreads=1``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zstandard

from ciuic.format import floatcodec

GB = 1e9


@dataclass
class Chunk:
    name: str
    kind: str  # floatcodec float kind
    itemsize: int
    data: bytes
    previous: bytes | None = None  # for the XOR delta


@dataclass
class Codec:
    name: str
    encode: Callable[[Chunk], bytes | None]
    decode: Callable[[Chunk, bytes], bytes]


# -- data ----------------------------------------------------------------------------------------


def make_chunks(nbytes: int, seed: int = 0) -> list[Chunk]:
    g = torch.Generator().manual_seed(seed)

    def as_bytes(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.uint8).numpy().tobytes()

    n4, n2 = nbytes // 4, nbytes // 2
    chunks = [
        Chunk("weights fp32", "f32", 4, as_bytes(torch.randn(n4, generator=g) * 0.02)),
        Chunk(
            "weights bf16",
            "bf16",
            2,
            as_bytes((torch.randn(n2, generator=g) * 0.02).to(torch.bfloat16)),
        ),
        Chunk(
            "weights fp16",
            "f16",
            2,
            as_bytes((torch.randn(n2, generator=g) * 0.02).to(torch.float16)),
        ),
        # As bench/run.py builds its reference state.
        Chunk("adam exp_avg fp32 (ref)", "f32", 4, as_bytes(torch.randn(n4, generator=g) * 1e-3)),
        Chunk("adam exp_avg_sq fp32 (ref)", "f32", 4, as_bytes(torch.rand(n4, generator=g) * 1e-6)),
    ]
    # Simulated: per-parameter gradient scales spread over orders of magnitude (log-normal), the
    # second moment an EMA of squared gradients after 20 steps (beta2 = 0.999).
    scale = torch.exp(torch.randn(n4, generator=g) * 1.5) * 1e-3
    v = torch.zeros(n4)
    for _ in range(20):
        v.mul_(0.999).add_(0.001 * (scale * torch.randn(n4, generator=g)) ** 2)
    chunks.append(Chunk("adam exp_avg_sq fp32 (sim)", "f32", 4, as_bytes(v)))
    # XOR delta: 1 % of the values of an fp32 chunk changed since the previous snapshot.
    prev = torch.randn(n4, generator=g) * 0.02
    cur = prev.clone()
    idx = torch.randperm(n4, generator=g)[: n4 // 100]
    cur[idx] = torch.randn(idx.numel(), generator=g) * 0.02
    chunks.append(Chunk("fp32 1% changed (delta)", "f32", 4, as_bytes(cur), as_bytes(prev)))
    return chunks


# -- codecs --------------------------------------------------------------------------------------


def split_planes(data: bytes, itemsize: int) -> tuple[list[np.ndarray[Any, Any]], bytes]:
    """Byte planes (least significant first) as contiguous arrays, and the tail."""
    n = len(data) // itemsize
    words = np.frombuffer(data, dtype=f"<u{itemsize}", count=n)
    planes = [(words >> (8 * k)).astype(np.uint8) for k in range(itemsize)]
    return planes, data[n * itemsize :]


def join_planes(planes: list[np.ndarray[Any, Any]], tail: bytes, size: int) -> bytes:
    out = np.empty(size, dtype=np.uint8)
    itemsize = len(planes)
    n = planes[0].size
    values = out[: n * itemsize].reshape(n, itemsize)
    for k, plane in enumerate(planes):
        values[:, k] = plane
    out[n * itemsize :] = np.frombuffer(tail, dtype=np.uint8)
    return out.tobytes()


def top_plane_codec(name: str, cctx: zstandard.ZstdCompressor) -> Codec:
    """Byte planes; zstd on the top plane only; the others raw (a length-prefixed container)."""
    dctx = zstandard.ZstdDecompressor()

    def encode(chunk: Chunk) -> bytes | None:
        planes, tail = split_planes(chunk.data, chunk.itemsize)
        top = cctx.compress(planes[-1].data)
        parts: list[Any] = [len(top).to_bytes(8, "little"), top]
        parts += [p.data for p in planes[:-1]]
        parts.append(tail)
        return b"".join(parts)

    def decode(chunk: Chunk, payload: bytes) -> bytes:
        itemsize, size = chunk.itemsize, len(chunk.data)
        n = size // itemsize
        top_len = int.from_bytes(payload[:8], "little")
        top = np.frombuffer(dctx.decompress(payload[8 : 8 + top_len]), dtype=np.uint8)
        off = 8 + top_len
        planes = []
        for _ in range(itemsize - 1):
            planes.append(np.frombuffer(payload, dtype=np.uint8, count=n, offset=off))
            off += n
        planes.append(top)
        return join_planes(planes, payload[off:], size)

    return Codec(name, encode, decode)


def make_codecs() -> list[Codec]:
    out_buffers: dict[int, memoryview] = {}

    def xor(data: bytes | memoryview, previous: bytes | None) -> bytes | memoryview:
        """The XOR delta against the previous snapshot's chunk (done here, outside the codec:
        ciuic does not write deltas; this measures what they would give)."""
        if previous is None:
            return data
        a = np.frombuffer(data, dtype=np.uint8)
        return np.bitwise_xor(a, np.frombuffer(previous, dtype=np.uint8)).tobytes()

    def fc_encode(chunk: Chunk) -> bytes | None:
        return floatcodec.encode(xor(chunk.data, chunk.previous), chunk.itemsize,
                                 float_kind=chunk.kind)

    def fc_decode(chunk: Chunk, payload: bytes) -> bytes:
        out = out_buffers.setdefault(len(chunk.data), memoryview(bytearray(len(chunk.data))))
        return bytes(xor(floatcodec.decode(payload, out), chunk.previous))

    z1 = zstandard.ZstdCompressor(level=1)
    zd = zstandard.ZstdDecompressor()
    codecs = [
        Codec("floatcodec", fc_encode, fc_decode),
        Codec("zstd-1", lambda c: z1.compress(c.data), lambda c, p: zd.decompress(p)),
        top_plane_codec("zstd-1-top", zstandard.ZstdCompressor(level=1)),
        top_plane_codec(
            "zstd-fast-top",
            zstandard.ZstdCompressor(compression_params=floatcodec.ZSTD_PARAMS),
        ),
    ]
    if importlib.util.find_spec("blosc2") is None:  # optional: only for the comparison
        return codecs

    def blosc(name: str, codec: str, filt: str) -> Codec:
        # Imported on first use, after the other codecs were measured: with blosc2 (and its
        # numexpr) loaded, this machine ran floatcodec about 10 % slower.
        def encode(chunk: Chunk) -> bytes | None:
            blosc2 = importlib.import_module("blosc2")
            blosc2.set_nthreads(1)
            out: bytes = blosc2.compress2(
                chunk.data,
                codec=getattr(blosc2.Codec, codec),
                clevel=1,
                typesize=chunk.itemsize,
                nthreads=1,
                filters=[getattr(blosc2.Filter, filt)],
            )
            return out

        def decode(chunk: Chunk, payload: bytes) -> bytes:
            out: bytes = importlib.import_module("blosc2").decompress2(payload, nthreads=1)
            return out

        return Codec(name, encode, decode)

    codecs.append(blosc("blosc2-shuffle-zstd1", "ZSTD", "SHUFFLE"))
    codecs.append(blosc("blosc2-bitshuffle-lz4", "LZ4", "BITSHUFFLE"))
    return codecs


# -- measurement ---------------------------------------------------------------------------------


def cpu_busy(interval: float = 0.25) -> float:
    """Fraction of all CPUs busy over ``interval`` (Linux /proc/stat; 0.0 elsewhere).

    Called while this process sleeps, so it measures the others: on a small shared machine a
    neighbour's load (memory bandwidth, caches) moves single-core throughput by 10-30 %.
    """

    def read() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # all, idle + iowait

    try:
        total0, idle0 = read()
        time.sleep(interval)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, 1.0 - (idle1 - idle0) / max(1, total1 - total0))


def wait_quiet(max_wait: float, threshold: float = 0.1) -> float:
    """Wait (at most ``max_wait`` s) until the other processes leave the CPUs idle."""
    deadline = time.monotonic() + max_wait
    busy = cpu_busy()
    while busy > threshold and time.monotonic() < deadline:
        busy = cpu_busy()
    return busy


def timed(fn: Callable[[], Any], reps: int) -> tuple[list[float], Any]:
    result = fn()  # warm-up (contexts, page faults)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return times, result


def speeds(nbytes: int, times: list[float]) -> dict[str, float]:
    rates = sorted(nbytes / t / GB for t in times)
    return {"min": rates[0], "median": statistics.median(rates), "max": rates[-1]}


def measure(chunk: Chunk, codec: Codec, reps: int, max_wait: float) -> dict[str, Any]:
    size = len(chunk.data)
    busy = wait_quiet(max_wait) if max_wait > 0 else None
    enc_times, payload = timed(lambda: codec.encode(chunk), reps)
    row: dict[str, Any] = {"data": chunk.name, "codec": codec.name, "raw_bytes": size}
    row["cpu_busy_before"] = busy
    row["encode_gbps"] = speeds(size, enc_times)
    if payload is None:  # declined: the chunk is stored raw
        row.update(stored_bytes=size, ratio=1.0, declined=True, decode_gbps=None)
        return row
    dec_times, back = timed(lambda: codec.decode(chunk, payload), reps)
    if back != chunk.data:
        raise AssertionError(f"{codec.name} did not round-trip {chunk.name}")
    row.update(stored_bytes=len(payload), ratio=len(payload) / size, declined=False)
    row["decode_gbps"] = speeds(size, dec_times)
    return row


def fmt(s: dict[str, float] | None) -> str:
    if s is None:
        return f"{'-':>17}"
    return f"{s['min']:5.2f}/{s['median']:5.2f}/{s['max']:5.2f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions (>= 7 advised)")
    ap.add_argument("--mib", type=float, default=4.0, help="chunk size in MiB")
    ap.add_argument("--json", type=Path, default=None, help="write the results there")
    ap.add_argument("--codecs", default="", help="comma-separated subset of codec names")
    ap.add_argument(
        "--max-wait",
        type=float,
        default=5.0,
        help="seconds to wait, before each measurement, for other processes to idle (0: never)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    nbytes = int(args.mib * (1 << 20)) // 8 * 8
    chunks = make_chunks(nbytes)
    codecs = make_codecs()
    if args.codecs:
        wanted = set(args.codecs.split(","))
        codecs = [c for c in codecs if c.name in wanted]
    rows = []
    for codec in codecs:  # codec-major: the optional blosc2 ones, imported on use, come last
        for chunk in chunks:
            if chunk.previous is None or codec.name == "floatcodec":  # only it does the delta
                rows.append(measure(chunk, codec, args.reps, args.max_wait))
                print(".", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(
        f"one {nbytes / (1 << 20):.2f} MiB chunk, {args.reps} reps, one thread; "
        "GB/s of raw bytes as min/median/max"
    )
    print(f"{'data':28} {'codec':22} {'ratio':>6}  {'encode GB/s':>17}  {'decode GB/s':>17}")
    order = {chunk.name: i for i, chunk in enumerate(chunks)}
    for row in sorted(rows, key=lambda r: order[r["data"]]):  # stable: codecs keep their order
        note = "  (declined: stored raw)" if row["declined"] else ""
        if (row["cpu_busy_before"] or 0.0) > 0.1:
            note += f"  (machine {row['cpu_busy_before']:.0%} busy before)"
        print(
            f"{row['data']:28} {row['codec']:22} {row['ratio']:6.3f}  "
            f"{fmt(row['encode_gbps'])}  {fmt(row['decode_gbps'])}{note}"
        )
    result = {
        "chunk_bytes": nbytes,
        "reps": args.reps,
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "numpy": np.__version__,
            "zstandard": zstandard.__version__,
        },
        "results": rows,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
