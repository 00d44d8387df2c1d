"""Load test of the server: N concurrent clients saving and restoring for a bounded time.

    .venv/bin/python bench/server_load.py [--clients 32] [--seconds 30] [--json FILE]

Starts ``ciuic serve`` (uvicorn, SQLite catalog, a fresh store) on a free loopback port, then runs
``--clients`` threads, each a ``ciuic_client.CiuicClient`` on its own job: save a snapshot (a
small model, one tensor changed each time, so every save is incremental), and every third
iteration restore the latest and compare it, byte for byte, with what was saved (``run``'s
``min_saves`` makes each client save at least that many times whatever the time). At the end every
snapshot any client saved is listed and read back and compared: a missing one is *lost*, a
different one *corrupted*. Prints the counts, throughput and latency percentiles.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch


def digest(data: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for k, v in sorted(data["model"].items()):
        h.update(k.encode() + v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    h.update(str(data["step"]).encode())
    return h.hexdigest()


def run(url: str, key: str, clients: int = 32, seconds: float = 30.0,
        min_saves: int = 0) -> dict[str, Any]:
    """Drive the server at ``url``; return the figures (see the module docstring). Each client
    saves at least ``min_saves`` times, however long that takes (a bounded amount of work, so
    that a slow machine still exercises the restores), and then until ``seconds`` passed."""
    from ciuic_client import CiuicClient

    deadline = time.monotonic() + seconds
    saved: dict[int, dict[str, str]] = {}  # client -> snapshot id -> digest
    lat_save: list[float] = []
    lat_restore: list[float] = []
    errors: list[str] = []
    mismatches: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        model = {f"layer{j}.weight": torch.randn(64, 64, generator=g) for j in range(4)}
        mine: dict[str, str] = {}
        try:
            with CiuicClient(api_key=key, endpoint=url, job=f"load-{i}") as c:
                n = 0
                while n < min_saves or time.monotonic() < deadline:
                    model[f"layer{n % 4}.weight"] += 0.01  # one tensor changes per save
                    data = {"model": model, "step": n}
                    t0 = time.perf_counter()
                    out = c.save_snapshot(data)
                    t1 = time.perf_counter()
                    mine[out["id"]] = digest(data)
                    if n % 3 == 2:
                        latest = c.get_latest_snapshot()
                        t2 = time.perf_counter()
                        if latest["id"] != out["id"] or digest(latest["data"]) != mine[out["id"]]:
                            with lock:
                                mismatches.append(f"client {i} step {n}: latest differs")
                        with lock:
                            lat_restore.append(t2 - t1)
                    with lock:
                        lat_save.append(t1 - t0)
                    n += 1
        except Exception as e:
            with lock:
                errors.append(f"client {i}: {type(e).__name__}: {e}")
        with lock:
            saved[i] = mine

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t_start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t_start
    lost, corrupted = _check_all(url, key, saved, errors)
    q = statistics.quantiles
    return {
        "clients": clients, "seconds": round(elapsed, 2), "saves": len(lat_save),
        "restores": len(lat_restore), "saves_per_s": round(len(lat_save) / elapsed, 1),
        "save_ms_p50": round(1000 * statistics.median(lat_save), 1) if lat_save else None,
        "save_ms_p95": round(1000 * q(lat_save, n=20)[18], 1) if len(lat_save) > 1 else None,
        "restore_ms_p50": round(1000 * statistics.median(lat_restore), 1) if lat_restore
        else None,
        "lost": lost, "corrupted": corrupted + len(mismatches), "errors": errors[:10],
        "error_count": len(errors),
    }


def _check_all(url: str, key: str, saved: dict[int, dict[str, str]],
               errors: list[str]) -> tuple[int, int]:
    """Read back every snapshot every client saved."""
    from ciuic_client import CiuicClient

    lost = corrupted = 0
    for i, mine in saved.items():
        try:
            with CiuicClient(api_key=key, endpoint=url, job=f"load-{i}") as c:
                listed = {s["id"] for s in c.list_snapshots()}
                for sid, want in mine.items():
                    if sid not in listed:
                        lost += 1
                        continue
                    if digest(c.get_snapshot(sid)["data"]) != want:
                        corrupted += 1
        except Exception as e:
            errors.append(f"checking client {i}: {type(e).__name__}: {e}")
    return lost, corrupted


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.serverutil import new_key, serve

    with tempfile.TemporaryDirectory(prefix="ciuic-load-") as tmp:
        store = Path(tmp) / "store"
        key = new_key(store, "load", "writer")
        with serve(store, Path(tmp) / "server.log") as url:
            out = run(url, key, a.clients, a.seconds)
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
