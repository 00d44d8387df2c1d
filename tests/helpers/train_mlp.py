"""A small deterministic training job for end-to-end tests (run as a subprocess).

    python tests/helpers/train_mlp.py --store DIR --steps 40 [--kill-at N] [--no-snapshots]

Prints ``DIGEST <hex>`` (BLAKE3 of the final model and optimizer state) and ``START <step>``.
Failpoints come from CIUIC_FAILPOINTS; ``--sleep-in-step`` widens the window for outside kills.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import blake3
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ciuic import ResumableSampler, SnapshotManager


def digest_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = blake3.blake3()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for pid, st in sorted(optimizer.state_dict()["state"].items()):
        for k, v in sorted(st.items()):
            h.update(f"{pid}/{k}".encode() + v.contiguous().view(-1).view(torch.uint8)
                     .numpy().tobytes())
    return h.hexdigest()


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, object, object, TensorDataset]:
    torch.manual_seed(seed)
    np.random.seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.7)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 16, generator=g)
    y = torch.randint(0, 4, (512,), generator=g)
    return model, optimizer, scheduler, None, TensorDataset(x, y)


class Batches:
    """The loader's batches, epoch after epoch."""

    def __init__(self, loader: DataLoader[tuple[torch.Tensor, ...]]) -> None:
        self.loader = loader
        self.it = iter(loader)

    def next(self) -> tuple[torch.Tensor, ...]:
        try:
            return next(self.it)  # type: ignore[no-any-return]
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)  # type: ignore[no-any-return]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object,
               batches: Batches) -> float:
    """One step of the test job; returns its loss."""
    x, y = batches.next()
    loss = nn.functional.cross_entropy(model(x), y)
    # exercise every RNG that a resume must restore
    noise = float(np.random.rand()) * 1e-3 + torch.rand(()).item() * 1e-3
    optimizer.zero_grad()
    (loss + noise).backward()
    optimizer.step()
    scheduler.step()  # type: ignore[attr-defined]
    return float(loss.item())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--job", default="mlp")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--no-snapshots", action="store_true")
    p.add_argument("--no-restore", action="store_true")
    p.add_argument("--sleep-in-step", type=float, default=0.0)
    p.add_argument("--keep-last", type=int, default=None)
    p.add_argument("--on-busy", default="wait", help="skip or wait (the default)")
    p.add_argument("--sync", action="store_true", help="synchronous snapshots")
    a = p.parse_args()
    torch.set_num_threads(1)
    model, optimizer, scheduler, _, dataset = build()
    sampler = ResumableSampler(dataset, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler, generator=torch.Generator())
    manager = None
    start = 0
    if not a.no_snapshots:
        manager = SnapshotManager("tests", job=a.job, store=a.store, save_interval=a.save_every,
                                  keep_last=a.keep_last, on_busy=a.on_busy,
                                  asynchronous=not a.sync)
        if not a.no_restore:
            last = manager.restore(model, optimizer, scheduler=scheduler, sampler=sampler)
            start = 0 if last is None else last + 1
    print(f"START {start}", flush=True)
    batches = Batches(loader)
    for step in range(start, a.steps):
        loss = train_step(model, optimizer, scheduler, batches)
        if manager is not None:
            manager.step(step, model, optimizer, scheduler=scheduler, sampler=sampler,
                         loss=loss)
        print(f"STEP {step}", flush=True)
        if a.sleep_in_step:
            time.sleep(a.sleep_in_step)
        if step == a.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    if manager is not None:
        manager.close()
    print(f"DIGEST {digest_state(model, optimizer)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
