"""Lightning's Trainer on 2 DDP ranks (gloo, CPU) under in-process recovery: the fit, from the
``Trainer`` (which forms the process group) to ``fit()``, in a function wrapped in
``ciuic.recoverable``, as docs/recovery.md says.

    ciuic run --nproc-per-node 2 [--spares 1] -- python tests/helpers/ip_pl_train.py \
        --out DIR [--fault STEP:RANK:ACTION]

An MLP with dropout on tests/helpers/noisy.py's data (noise from the global RNG, a shuffled
loader), Adam and a StepLR, ``CiuicCallback`` snapshotting every 5 steps into DIR/store.
``--fault``: at the end of global step STEP, rank RANK is SIGKILLed (``kill``) or raises
(``raise``), once (a marker file in DIR). Each rank appends ``{"step", "time", "gen"}`` to
DIR/steps-RANK.jsonl at each step's end; at the end rank 0 writes every model and optimizer
tensor to DIR/final-ciuic.safetensors.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from finalstate import write_final  # beside this script
from ip_faults import StepEnd
from leave import leave
from noisy import Noisy
from torch import nn
from torch.utils.data import DataLoader

import ciuic
from ciuic.integrations.lightning import CiuicCallback


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)]

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(Noisy(48), batch_size=4, shuffle=True)


class Steps(pl.Callback):
    """Each step's end to :class:`~ip_faults.StepEnd` (its log, the fault)."""

    def __init__(self, out: Path, fault: str | None) -> None:
        self.end = StepEnd(out, fault)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.end(trainer.global_step)


@ciuic.recoverable
def fit(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Tiny()
    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))  # each rank its own RNG stream
    callback = CiuicCallback("pl", job="ip", store=str(a.out / "store"), every_n_train_steps=5)
    trainer = pl.Trainer(
        max_epochs=3, accelerator="cpu", devices=2, strategy="ddp",
        callbacks=[callback, Steps(a.out, a.fault)], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
        limit_val_batches=0, default_root_dir=str(a.out / "root"))
    trainer.fit(model)
    if trainer.global_rank == 0:
        write_final(model, trainer.optimizers, a.out / "final-ciuic.safetensors")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--fault", default=None, metavar="STEP:RANK:ACTION")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    fit(a)


if __name__ == "__main__":
    main()
    leave(0)  # not a return to the interpreter: see tests/helpers/leave.py
