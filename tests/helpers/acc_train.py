"""A tiny Accelerate training loop for the integration tests (a subprocess, or under torchrun).

    python tests/helpers/acc_train.py --out DIR --mode ciuic|acc [--kill-at STEP]
        [--accumulate N] [--every N] [--fsdp 1|2]

An MLP with dropout on data whose ``__getitem__`` adds noise from torch's global RNG, shuffled
by a ``DataLoader(shuffle=True)``, AdamW and a LambdaLR schedule, prepared by an
``Accelerator``; 3 epochs. ``--mode ciuic`` snapshots with AccelerateSnapshots into DIR/store
every ``--every`` optimizer steps; ``--mode acc`` with ``accelerator.save_state`` into
DIR/acc/step_N, resuming as Accelerate's examples do (``load_state`` of the newest folder, then
``skip_first_batches`` in the resumed epoch). ``--kill-at`` SIGKILLs every process at the end
of that optimizer step (once the last due snapshot is committed, so that the test knows which
one the restart resumes from). At a normal end the main process writes DIR/final-MODE.safetensors.

``--fsdp 2`` (or ``1``), under torchrun: the model sharded by Accelerate's FSDP plugin
(``FullyShardedDataParallelPlugin(fsdp_version=...)``, sharded state dicts for ``save_state``),
made to run on the CPU by ``cpu_shims.accelerate_fsdp_on_cpu``; the final state is then gathered
from every process's shards. FSDP1 needs the model prepared before its optimizer is built.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from finalstate import write_final, write_final_gathered  # beside this script
from leave import leave
from noisy import Noisy
from torch import nn
from torch.utils.data import DataLoader


class Counter:
    """An object given to register_for_checkpointing (it must come back too)."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = int(state["seen"])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["ciuic", "acc"], default="ciuic")
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--fsdp", type=int, choices=[0, 1, 2], default=0)
    a = p.parse_args()
    out = Path(a.out)
    # one thread: a loaded machine can make a multi-threaded kernel sum in another order (seen:
    # last-bit differences in one slow-suite run in the clean-clone CI)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plugin: Any = None
    if a.fsdp:
        from accelerate.utils import FullyShardedDataParallelPlugin
        from cpu_shims import accelerate_fsdp_on_cpu

        plugin = FullyShardedDataParallelPlugin(fsdp_version=a.fsdp,
                                                state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(gradient_accumulation_steps=a.accumulate, cpu=True,
                              fsdp_plugin=plugin)
    if plugin is not None:
        accelerate_fsdp_on_cpu(accelerator, plugin)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    if a.fsdp == 1:  # FSDP1 flattens the parameters: the optimizer takes the flat ones
        model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.05 * s))
    loader = DataLoader(Noisy(48), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader,
                                                              scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    first_epoch, skip, global_step = 0, 0, 0
    snapshots: Any = None
    if a.mode == "ciuic":
        from ciuic.integrations.accelerate import AccelerateSnapshots

        snapshots = AccelerateSnapshots(accelerator, "tests", job="acc", store=out / "store",
                                        save_interval=a.every, handle_signals=False)
        first_epoch = snapshots.restore()
        global_step = snapshots.global_step
    else:
        folders = sorted((out / "acc").glob("step_*"), key=lambda f: int(f.name[5:]))
        if folders:
            accelerator.load_state(str(folders[-1]))
            global_step = int(folders[-1].name[5:])
            per_epoch = len(loader) // a.accumulate
            first_epoch, done = divmod(global_step, per_epoch)
            skip = done * a.accumulate
            print(f"Resuming the Accelerate loop at global step {global_step}", file=sys.stderr)
    for epoch in range(first_epoch, a.epochs):
        active = (accelerator.skip_first_batches(loader, skip) if skip and epoch == first_epoch
                  else loader)
        for x, y in active:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            counter.seen += len(y)
            if snapshots is not None:
                snapshots.step(loss=loss.item())
                global_step = snapshots.global_step
            elif accelerator.sync_gradients:
                global_step += 1
                if global_step % a.every == 0:
                    accelerator.save_state(str(out / "acc" / f"step_{global_step}"))
            if accelerator.sync_gradients and global_step == a.kill_at:
                if snapshots is not None:  # the last due snapshot committed: a known restart
                    snapshots.manager.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    if snapshots is not None:
        snapshots.finish()
        snapshots.close()
    accelerator.wait_for_everyone()
    path = out / f"final-{a.mode}.safetensors"
    if a.fsdp:  # every process takes part in gathering the shards
        write_final_gathered(model, optimizer.optimizer, path, accelerator.is_main_process)
    if accelerator.is_main_process:
        if not a.fsdp:
            write_final(accelerator.unwrap_model(model), optimizer, path)
        print(f"GLOBAL_STEP {global_step} SEEN {counter.seen} STEP {accelerator.step}")
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())  # not sys.exit: see tests/helpers/leave.py
