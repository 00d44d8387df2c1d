"""A torchtitan-style training loop for the integration tests (run under torchrun, CPU, gloo).

    torchrun --nproc_per_node 2 tests/helpers/tt_train.py --out DIR --mode ciuic|titan
        [--kill-at STEP] [--every N] [--steps N]

The loop is torchtitan's ``Trainer.train`` with its components (torchtitan's own Trainer on its
own llama3 is tests/helpers/tt_main.py): an MLP with dropout, FSDP2 (``fully_shard`` over a
2-rank CPU mesh, per layer and whole), torchtitan's ``OptimizersContainer`` (AdamW) and
``LRSchedulersContainer`` (warmup, then linear decay), its ``ParallelAwareDataloader`` over a
stateful, sharded, reshuffled-per-epoch stream whose samples get noise from torch's global RNG,
and a ``train_state`` (step, samples seen). The checkpointer is built the way the trainer builds
it, from its config: ``--mode ciuic`` selects ``CiuicCheckpointManager.Config``, ``--mode titan``
torchtitan's own DCP ``CheckpointManager.Config``. ``--kill-at`` SIGKILLs every rank at the end
of that step (the last due snapshot committed). At the end rank 0 writes
DIR/final-MODE.safetensors: every rank's model shards and optimizer state, and the LR.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from leave import leave  # beside this script
from noisy import Noisy  # beside this script
from safetensors.torch import save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An endless stream over this rank's share of a dataset, reshuffled each pass (as
    torchtitan's datasets are endless); its position is its state."""

    def __init__(self, rank: int, world: int, n: int = 48) -> None:
        self.data, self.rank, self.world = Noisy(n), rank, world
        self.epoch, self.index = 0, 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            order = torch.randperm(len(self.data), generator=torch.Generator().manual_seed(
                100 + self.epoch))[self.rank::self.world].tolist()
            while self.index < len(order):
                i = order[self.index]
                self.index += 1
                yield self.data[i]
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def build(mesh: Any, rank: int, world: int) -> tuple[nn.Module, IterableDataset[Any]]:
    """The model, sharded with FSDP2 per layer and whole, and its data."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, Stream(rank, world)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class TrainState:
    """What torchtitan's Trainer gives the checkpointer as ``states["train_state"]``."""

    def __init__(self) -> None:
        self.step, self.samples = 0, 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.samples = int(state["step"]), int(state["samples"])


def local(t: torch.Tensor) -> torch.Tensor:
    inner = t.to_local() if hasattr(t, "to_local") else t
    return inner.detach().clone().contiguous().reshape(-1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["ciuic", "titan"], default="ciuic")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--steps", type=int, default=18)
    a = p.parse_args()
    out = Path(a.out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    # one thread: a loaded machine can make a multi-threaded kernel sum in another order (seen:
    # last-bit differences in one slow-suite run in the clean-clone CI)
    torch.set_num_threads(1)
    model, data = build(mesh, rank, world)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 0.01, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=3).build(
        optimizers=optimizers, training_steps=a.steps)
    dataloader = ParallelAwareDataloader(data, dp_rank=rank,
                                         dp_world_size=world, batch_size=4)
    train_state = TrainState()
    config: Any
    if a.mode == "ciuic":
        from ciuic.integrations.torchtitan import CiuicCheckpointManager

        config = CiuicCheckpointManager.Config(enable=True, interval=a.every, keep_latest_k=0,
                                               project="tests", job="tt")
    else:
        config = CheckpointManager.Config(enable=True, folder="dcp", interval=a.every,
                                          keep_latest_k=0, last_save_model_only=False)
    checkpointer = config.build(dataloader=dataloader, model_parts=[model],
                                optimizers=optimizers, lr_schedulers=lr_schedulers,
                                states={"train_state": train_state}, sd_adapter=None,
                                base_folder=str(out))
    # Trainer.train(): load, then iterate the (restored) loader
    checkpointer.load(step=-1)
    if train_state.step and rank == 0:
        print(f"Resuming the torchtitan loop at global step {train_state.step}",
              file=sys.stderr)
    batches = iter(dataloader)
    while train_state.step < a.steps:
        train_state.step += 1
        x, y = next(batches)
        loss = loss_of(model, x, y)
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        train_state.samples += len(x)
        checkpointer.save(train_state.step, last_step=train_state.step == a.steps)
        if train_state.step == a.kill_at:
            if a.mode == "ciuic":
                checkpointer.manager.wait()
            os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.close()
    mine = {f"model/{k}": local(v) for k, v in model.named_parameters()}
    for name, param in model.named_parameters():
        for k, v in optimizers.optimizers[0].state[param].items():
            mine[f"optimizer/{name}/{k}"] = local(v)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, mine)
    if rank == 0:
        tensors = {k.replace("/", f"/rank{r}/", 1): v for r, part in enumerate(parts)
                   for k, v in part.items()}
        tensors["lr"] = torch.tensor(lr_schedulers.schedulers[0].get_last_lr(),
                                     dtype=torch.float64)
        save_file(tensors, str(out / f"final-{a.mode}.safetensors"))
        print(f"STEP {train_state.step} SAMPLES {train_state.samples}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())  # not sys.exit: see tests/helpers/leave.py
