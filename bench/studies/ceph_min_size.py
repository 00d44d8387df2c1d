"""What a Ceph cluster below ``min_size`` costs a client and a training job (issue 42, item 14):
how long each store call takes to fail, and how long ``step()`` waits with ``on_busy="wait"``.

    .venv/bin/python bench/studies/ceph_min_size.py [--op-timeout 5] [--json FILE]

Starts the test cluster of tests/cluster.py (3 OSDs, pools 3/2, ``rados osd op timeout`` and
``rados mon op timeout`` ``--op-timeout`` s) on 127.0.0.1, trains a small model with
``SnapshotManager`` (asynchronous, ``on_busy="wait"``, a snapshot every 5 steps, ciuic's default
knobs: ``store_attempts`` 3, ``store_timeout_s`` 120, ``s3_read_timeout_s`` 60, botocore's 5
adaptive attempts), kills 2 of the 3 OSDs (SIGKILL, and waits until the monitor marks them
down), then measures, with ciuic's defaults:

- each call of a fresh S3 store (``open_store``: botocore's tries, without the
  ``RetryingStore`` a repository adds; PUT of a new key, GET and HEAD of an existing one, a
  listing) from its start until it raises;
- the training loop: the time from the kill to the first "snapshot ... failed" warning, and the
  longest ``step()`` call meanwhile (the steps a failing snapshot blocks).

Prints each figure and the machine's load beside them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests import cluster  # noqa: E402

from ciuic import SnapshotManager  # noqa: E402
from ciuic.store import open_store  # noqa: E402


class Failures(logging.Handler):
    """Notes when a snapshot's failure is logged."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.at: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "failed" in text and "snapshot" in text:
            self.at.append((time.monotonic(), text))


def timed_failure(call: Any) -> tuple[float, str]:
    t0 = time.monotonic()
    try:
        call()
    except Exception as e:  # the figure is how long until it raised
        return time.monotonic() - t0, f"{type(e).__name__}: {str(e)[:200]}"
    return time.monotonic() - t0, "succeeded"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--op-timeout", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    bounded = {**cluster.BOUNDED, "rados osd op timeout": str(a.op_timeout),
               "rados mon op timeout": str(a.op_timeout)}
    old, cluster.BOUNDED = cluster.BOUNDED, bounded
    out: dict[str, Any] = {"op_timeout_s": a.op_timeout, "load_before": os.getloadavg()}
    try:
        with cluster.running(block_bytes=2 << 30) as cl:
            for k, v in cl.env.items():
                os.environ[k] = v
            url = cl.url(cl.make_bucket())
            open_store(url).put("k", b"1")
            failures = Failures()
            logging.getLogger("ciuic").addHandler(failures)
            model = torch.nn.Linear(256, 256)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            steps: list[tuple[float, float]] = []  # (start, duration) of each step() call
            stop = threading.Event()
            killed = threading.Event()

            def train() -> None:
                with SnapshotManager("bench", job="min-size", store=url, save_interval=5,
                                     on_busy="wait", handle_signals=False) as m:
                    step = 0
                    while not stop.is_set():
                        model(torch.randn(8, 256)).sum().backward()
                        opt.step()
                        t0 = time.monotonic()
                        m.step(step, model, opt)
                        steps.append((t0, time.monotonic() - t0))
                        step += 1
                        time.sleep(0.2)

            trainer = threading.Thread(target=train, daemon=True)
            trainer.start()
            while len(steps) < 12:
                time.sleep(0.2)
            cl.kill_osd(1)
            cl.kill_osd(2)
            kill = time.monotonic()
            killed.set()
            out["load_at_kill"] = os.getloadavg()
            calls = {"put": lambda: open_store(url).put("new", b"2"),
                     "get": lambda: open_store(url).get("k"),
                     "has": lambda: open_store(url).has("k"),
                     "list": lambda: list(open_store(url).list(""))}
            results: dict[str, tuple[float, str]] = {}

            def measure(name: str) -> None:
                results[name] = timed_failure(calls[name])

            threads = [threading.Thread(target=measure, args=(n,)) for n in calls]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            deadline = time.monotonic() + 600
            while not failures.at and time.monotonic() < deadline:
                time.sleep(0.5)
            first = failures.at[0][0] - kill if failures.at else None
            after = [d for t0, d in steps if t0 + d >= kill]
            stop.set()
            cl.start_osd(1)
            cl.start_osd(2)
            trainer.join(300)
            out.update({
                "calls": {n: {"s": round(s, 1), "error": e} for n, (s, e) in results.items()},
                "first_snapshot_failure_after_kill_s": None if first is None else round(first, 1),
                "snapshot_failure": failures.at[0][1][:400] if failures.at else None,
                "longest_step_after_kill_s": round(max(after, default=0.0), 1),
                "steps_after_kill": len(after),
            })
    finally:
        cluster.BOUNDED = old
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
