"""A tiny Lightning fit for the integration tests (run as a subprocess, or under torchrun).

    python tests/helpers/pl_train.py --out DIR --mode ciuic|pl [--kill-at STEP] [--ddp]

An MLP with dropout on random data whose ``__getitem__`` adds noise from torch's global RNG,
shuffled by a plain ``DataLoader(shuffle=True)`` (its order also drawn from the global RNG; with
``--generator`` from the loader's own ``torch.Generator()``), with Adam and a StepLR scheduler.
``--kill-at`` SIGKILLs the process (every rank: each kills itself) at the end of that global
step. ``--mode ciuic`` fits with CiuicCallback into DIR/store;
``--mode pl`` with Lightning's ModelCheckpoint (every 5 steps, DIR/pl) and ``ckpt_path="last"``.
``--package pytorch_lightning`` uses that package instead of ``lightning.pytorch``.
``--schedule step``: a OneCycleLR stepped each batch; ``--two-optimizers``: manual optimization
with two optimizers and two schedulers (``global_step`` then counts both optimizers' steps). At
a normal end rank 0 writes DIR/final-MODE.safetensors: every model and optimizer tensor, by name.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from finalstate import write_final  # beside this script
from leave import leave
from noisy import Noisy
from torch import nn
from torch.utils.data import DataLoader


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["ciuic", "pl"], default="ciuic")
    p.add_argument("--package", default="lightning.pytorch")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--devices", type=int, default=2, help="processes with --ddp")
    p.add_argument("--val", action="store_true", help="validate at each epoch's end")
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--generator", action="store_true",
                   help="the train loader shuffles with its own torch.Generator()")
    p.add_argument("--schedule", choices=["epoch", "step"], default="epoch",
                   help="step the LR scheduler each epoch (StepLR) or each step (OneCycleLR)")
    p.add_argument("--two-optimizers", action="store_true",
                   help="manual optimization: Adam for the first layer, SGD with momentum "
                   "for the last, each with its own scheduler stepped each batch")
    a = p.parse_args()
    pl: Any = importlib.import_module(a.package)
    out = Path(a.out)
    ciuic_mod = importlib.import_module(
        "ciuic.integrations.lightning" if a.package == "lightning.pytorch"
        else "ciuic.integrations.pytorch_lightning")

    class Tiny(pl.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"width": 32, "lr": 0.01})
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3),
                                     nn.Linear(32, 3))

            self.automatic_optimization = not a.two_optimizers

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            if a.two_optimizers:  # as a GAN's or a two-tower model's step is written
                optimizers, schedulers = self.optimizers(), self.lr_schedulers()
                self.manual_backward(loss)
                for opt in optimizers:
                    opt.step()
                    opt.zero_grad()
                for sched in schedulers:
                    sched.step()
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

        def configure_optimizers(self) -> Any:
            if a.two_optimizers:
                first = torch.optim.Adam(self.net[0].parameters(), lr=0.01)
                last = torch.optim.SGD(self.net[3].parameters(), lr=0.05, momentum=0.9)
                return [first, last], [torch.optim.lr_scheduler.StepLR(first, 5, 0.9),
                                       torch.optim.lr_scheduler.ExponentialLR(last, 0.97)]
            opt = torch.optim.Adam(self.parameters(), lr=0.01)
            if a.schedule == "step":
                return {"optimizer": opt, "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.OneCycleLR(
                        opt, max_lr=0.05, total_steps=self.trainer.estimated_stepping_batches),
                    "interval": "step"}}
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)]

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Noisy(48), batch_size=4, shuffle=True,
                              generator=torch.Generator() if a.generator else None)

        def val_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Noisy(8), batch_size=4)

    class KillAt(pl.Callback):  # type: ignore[misc,name-defined]
        def __init__(self, step: int | None, ciuic: Any = None) -> None:
            self.step, self.ciuic = step, ciuic

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if self.step is not None and trainer.global_step == self.step:
                if self.ciuic is not None and self.ciuic.manager is not None:
                    self.ciuic.manager.wait()
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    # one thread: a loaded machine can make a multi-threaded kernel sum in another order (seen:
    # last-bit differences in one slow-suite run in the clean-clone CI)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Tiny()
    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))  # each rank its own RNG stream
    callbacks: list[Any] = []
    ckpt_path = None
    if a.mode == "ciuic":
        ciuic = ciuic_mod.CiuicCallback("pl", job="tiny", store=str(out / "store"),
                                        every_n_train_steps=a.every, handle_signals=False)
        callbacks = [ciuic, KillAt(a.kill_at, ciuic)]  # ciuic first: its snapshot, then kill
    else:
        callbacks = [pl.callbacks.ModelCheckpoint(dirpath=str(out / "pl"), save_last=True,
                                                  every_n_train_steps=a.every, save_top_k=-1),
                     KillAt(a.kill_at)]
        if (out / "pl" / "last.ckpt").exists():
            ckpt_path = "last"
    trainer = pl.Trainer(
        max_epochs=3, accelerator="cpu", devices=a.devices if a.ddp else 1,
        strategy="ddp" if a.ddp else "auto", callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=a.mode == "pl", num_sanity_val_steps=0 if not a.val else 2,
        limit_val_batches=None if a.val else 0, accumulate_grad_batches=a.accumulate,
        default_root_dir=str(out / "root"))
    trainer.fit(model, ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        write_final(model, trainer.optimizers, out / f"final-{a.mode}.safetensors")
        print("GLOBAL_STEP", trainer.global_step)
    if torch.distributed.is_initialized():  # --ddp: every rank done, then the group gone
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())  # not sys.exit: see tests/helpers/leave.py
