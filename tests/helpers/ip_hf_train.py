"""Hugging Face's Trainer on 2 DDP ranks (gloo, CPU) under in-process recovery: the training,
from the ``TrainingArguments`` (which form the process group through accelerate) to
``train()``, in a function wrapped in ``ciuic.recoverable``, as docs/recovery.md says.

    ciuic run --nproc-per-node 2 [--spares 1] -- python tests/helpers/ip_hf_train.py \
        --out DIR [--fault STEP:RANK:ACTION]

The tiny GPT-2 and data of tests/helpers/hf_train.py, ``CiuicTrainer`` snapshotting every 5
steps into DIR/store. ``--fault``: at the end of global step STEP, rank RANK is SIGKILLed
(``kill``) or raises (``raise``), once (a marker file in DIR). Each rank appends ``{"step",
"time", "gen"}`` to DIR/steps-RANK.jsonl at each step's end; at the end rank 0 writes every
model and optimizer tensor to DIR/final-ciuic.safetensors.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from finalstate import write_final  # beside this script
from hf_train import Augmented, gpt2
from ip_faults import StepEnd
from leave import leave
from transformers import TrainerCallback, TrainingArguments

import ciuic
from ciuic import SnapshotManager
from ciuic.integrations.transformers import CiuicTrainer


class Steps(TrainerCallback):
    """Each step's end to :class:`~ip_faults.StepEnd` (its log, the fault)."""

    def __init__(self, out: Path, fault: str | None) -> None:
        self.end = StepEnd(out, fault)

    def on_step_end(self, args: object, state: object, control: object, **kw: object) -> None:
        self.end(int(getattr(state, "global_step", 0)))


@ciuic.recoverable
def train(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt2()
    args = TrainingArguments(
        output_dir=str(a.out / "hf"), per_device_train_batch_size=4, max_steps=a.steps,
        learning_rate=1e-3, lr_scheduler_type="linear", warmup_steps=3, weight_decay=0.01,
        save_strategy="steps", save_steps=5, logging_steps=5, report_to=[], seed=42,
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True)
    with SnapshotManager("hf", job="ip", store=a.out / "store") as manager:
        trainer = CiuicTrainer(model=model, args=args, train_dataset=Augmented(64),
                               callbacks=[Steps(a.out, a.fault)], ciuic=manager)
        trainer.train()
    if dist.get_rank() == 0:
        write_final(trainer.model, trainer.optimizer, a.out / "final-ciuic.safetensors")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fault", default=None, metavar="STEP:RANK:ACTION")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    train(a)


if __name__ == "__main__":
    main()
    leave(0)  # not a return to the interpreter: see tests/helpers/leave.py
