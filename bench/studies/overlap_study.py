"""Would writing chunks while the stall still copies (naming them after) beat today's order?

    .venv/bin/python bench/studies/overlap_study.py [--rounds 5] [--dir /var/tmp/ciuic-overlap]

A bare emulation of a full snapshot of bench/run.py's module state (its tensors of 4 MiB or
more, 0.98 GiB), without ciuic, interleaved round by round:

- ``floor``: the bytes alone, 4 MiB direct writes from 4 threads, then fsync;
- ``copy``: the stall's copy into buffers allocated ahead;
- ``today``: ciuic's order: copy everything (the stall), then 2 naming threads (BLAKE3 and the
  statistics) feed 4 direct-write threads, each file renamed to its digest, then fsync;
- ``before_name``: each tensor's pieces are handed to the write threads as soon as it is
  copied, while the copy goes on; the naming threads start after the copy and rename each
  file once it is written and named (a design the writer could take: docs/benchmarks.md,
  "Where a snapshot's time goes").

Prints each variant's stall and time to durable (min / median / max).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import blake3
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: measure, states

from measure import fsync_path, machine, summary
from states import module_state

CHUNK = 4 << 20
Piece = tuple[str, memoryview, np.ndarray]  # (name, bytes, elements)


class Study:
    def __init__(self, base: Path) -> None:
        state = module_state(1, optimizer="adam")
        self.tensors = [t for t in state.flat.values() if t.numel() * t.element_size() >= CHUNK]
        self.maps = [mmap.mmap(-1, t.numel() * t.element_size()) for t in self.tensors]
        self.bufs = [torch.frombuffer(m, dtype=t.dtype, count=t.numel()).view(t.shape)
                     for m, t in zip(self.maps, self.tensors, strict=True)]
        self.copy_all()
        self.base = base

    def copy_all(self, staged: Callable[[int], None] | None = None) -> None:
        for i, (t, b) in enumerate(zip(self.tensors, self.bufs, strict=True)):
            b.copy_(t)
            if staged is not None:
                staged(i)

    def pieces(self, i: int) -> list[Piece]:
        view, flat = memoryview(self.maps[i]), self.bufs[i].view(-1)
        n = flat.element_size()
        return [(f"{i}-{off}", view[off:off + CHUNK], flat[off // n:(off + CHUNK) // n].numpy())
                for off in range(0, len(view), CHUNK)]

    def fresh(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)
        (self.base / "tmp").mkdir(parents=True)
        for k in range(256):
            (self.base / f"{k:02x}").mkdir()
        os.sync()
        time.sleep(0.3)

    def write_tmp(self, piece: Piece) -> Path:
        path = self.base / "tmp" / piece[0]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DIRECT", 0))
        try:
            os.pwrite(fd, piece[1], 0)
        finally:
            os.close(fd)
        return path

    def final(self, piece: Piece) -> Path:
        """Name a piece (BLAKE3 and the statistics' four reductions): its final path."""
        digest = blake3.blake3(piece[1]).hexdigest()
        a = piece[2]
        a.sum(), np.dot(a, a), a.min(), a.max()
        return self.base / digest[:2] / digest

    def sync(self, paths: list[Path]) -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(fsync_path, paths))
            list(pool.map(fsync_path, {p.parent for p in paths}))

    def all_pieces(self) -> list[Piece]:
        return [p for i in range(len(self.tensors)) for p in self.pieces(i)]

    def floor(self) -> tuple[float, float]:
        self.fresh()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as io:
            paths = list(io.map(self.write_tmp, self.all_pieces()))
        self.sync(paths)
        return 0.0, time.perf_counter() - t0

    def copy(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.copy_all()
        return time.perf_counter() - t0, 0.0

    def today(self) -> tuple[float, float]:
        self.fresh()
        t0 = time.perf_counter()
        self.copy_all()
        stall = time.perf_counter() - t0
        with ThreadPoolExecutor(4) as io, ThreadPoolExecutor(2) as naming:
            def named(piece: Piece) -> Future[Path]:
                final = self.final(piece)
                return io.submit(lambda: self.write_tmp(piece).replace(final))

            writes = list(naming.map(named, self.all_pieces()))
            paths = [w.result() for w in writes]
        self.sync(paths)
        return stall, time.perf_counter() - t0

    def before_name(self) -> tuple[float, float]:
        self.fresh()
        t0 = time.perf_counter()
        writes: list[tuple[Piece, Future[Path]]] = []
        with ThreadPoolExecutor(4) as io, ThreadPoolExecutor(2) as naming:
            self.copy_all(lambda i: writes.extend((p, io.submit(self.write_tmp, p))
                                                  for p in self.pieces(i)))
            stall = time.perf_counter() - t0

            def link(item: tuple[Piece, Future[Path]]) -> Path:
                final = self.final(item[0])
                return item[1].result().replace(final)

            paths = list(naming.map(link, writes))
        self.sync(paths)
        return stall, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/ciuic-overlap"))
    ap.add_argument("--json", type=Path, default=None, help="also write results here")
    a = ap.parse_args(argv)
    study = Study(a.dir)
    variants = {"floor": study.floor, "copy": study.copy, "today": study.today,
                "before_name": study.before_name}
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    try:
        for r in range(a.rounds):
            for k in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                results[k].append(variants[k]())
    finally:
        shutil.rmtree(a.dir, ignore_errors=True)
    size = sum(len(m) for m in study.maps)
    print(f"{len(study.tensors)} tensors, {size / 2**30:.3f} GiB; {a.rounds} rounds")
    for k, xs in results.items():
        print(f"{k:<12} stall {summary([x[0] for x in xs])} s  durable "
              f"{summary([x[1] for x in xs])} s")
    med = {k: statistics.median(x[1] for x in xs) for k, xs in results.items()}
    print(f"before_name / today, durable: {med['before_name'] / med['today']:.3f}")
    if a.json:
        a.json.write_text(json.dumps({"state_bytes": size, "rounds": results,
                                      "machine": machine()}, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
