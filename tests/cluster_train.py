"""The test job of tests/helpers/train_mlp.py, for the cluster tests (run as a subprocess):
it prints the digest of the state each snapshot holds, so that a test can restore every
committed snapshot and compare it bit for bit, and it trains until a file appears.

    python -m tests.cluster_train --store URL [--until FILE] [--steps N] [--save-every K]

Prints ``START <step>``, ``STEP <n>`` after each step, ``STATE <n> <digest>`` for each step a
snapshot is taken at (the model and optimizer digest it holds), ``DIGEST <hex>`` at the end.
``--attempts`` and ``--timeout`` set the store's retry bounds (knobs.store_attempts,
store_timeout_s).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from ciuic import ResumableSampler, SnapshotManager, knobs
from tests.helpers.train_mlp import Batches, build, digest_state, train_step


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--job", default="mlp")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--until", type=Path, default=None,
                   help="train until this file exists (at most --steps steps)")
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds of sleep in each step")
    p.add_argument("--on-busy", default="wait")
    p.add_argument("--attempts", type=int, default=None)
    p.add_argument("--timeout", type=float, default=None)
    a = p.parse_args()
    changes: dict[str, object] = {}
    if a.attempts is not None:
        changes["store_attempts"] = a.attempts
    if a.timeout is not None:
        changes["store_timeout_s"] = a.timeout
    with knobs.override(**changes):
        return train(a)


def train(a: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    model, optimizer, scheduler, _, dataset = build()
    sampler = ResumableSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, generator=torch.Generator())
    manager = SnapshotManager("tests", job=a.job, store=a.store, save_interval=a.save_every,
                              on_busy=a.on_busy, handle_signals=False)
    last = manager.restore(model, optimizer, scheduler=scheduler, sampler=sampler)
    start = 0 if last is None else last + 1
    print(f"START {start}", flush=True)
    batches = Batches(loader)
    step = start
    while step < a.steps and not (a.until is not None and a.until.exists()):
        loss = train_step(model, optimizer, scheduler, batches)
        if step % a.save_every == 0:
            print(f"STATE {step} {digest_state(model, optimizer)}", flush=True)
        manager.step(step, model, optimizer, scheduler=scheduler, sampler=sampler,
                     loss=loss)
        print(f"STEP {step}", flush=True)
        if a.sleep:
            time.sleep(a.sleep)
        step += 1
    print(f"STATE {step - 1} {digest_state(model, optimizer)}", flush=True)  # the final one
    manager.close()
    print(f"DIGEST {digest_state(model, optimizer)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
