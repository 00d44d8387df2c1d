"""A tiny DeepSpeed training loop for the integration tests (run under torchrun, CPU, gloo).

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/helpers/ds_train.py --out DIR
        --mode ciuic|ds --stage 0|1|2|3 [--kill-at STEP] [--accumulate N] [--every N]
        [--generator] [--batchnorm] [--step-first]

An MLP with dropout on data whose ``__getitem__`` adds noise from torch's global RNG, a
``DistributedSampler(shuffle=True)`` (``--generator``: each rank's half of the data shuffled by
``DataLoader(shuffle=True, generator=torch.Generator())``), AdamW and a LambdaLR schedule handed
to ``deepspeed.initialize``; 3 epochs (``--batchnorm``: a ``BatchNorm1d`` after the first
layer, buffers each rank updates on its own). ``--mode ciuic`` snapshots with DeepSpeedSnapshots
into DIR/store every ``--every`` optimizer steps (``--step-first``: restoring into an engine
that has trained a step, on zeros, as a rollback in a running job does); ``--mode ds`` with
``engine.save_checkpoint`` into DIR/ds, resuming as DeepSpeed users do (``load_checkpoint`` of
the latest tag, the epoch and the batches to skip computed from ``global_steps``).
``--kill-at`` SIGKILLs every rank at the end of that optimizer step (once the last due snapshot
is committed). At a normal end rank 0 writes DIR/final-MODE.safetensors: the module's tensors
(under ZeRO-3 gathered from every rank's partition) and every rank's optimizer state.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from leave import leave  # beside this script
from noisy import Noisy  # beside this script
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset


def unpadded(flat: torch.Tensor, group: list[Any]) -> torch.Tensor:
    """A ZeRO-3 flat partition without its padding: each parameter's partition is padded to
    the same size on every rank, and DeepSpeed leaves the padding uninitialized
    (``torch.empty``), so it differs between any two runs and belongs to no parameter."""
    pieces, offset = [], 0
    for p in group:
        size = p.partition_numel()
        pieces.append(flat.narrow(0, offset, max(0, min(p.ds_numel - dist.get_rank() * size,
                                                        size))))
        offset += size
    return torch.cat(pieces).detach().clone()


def optimizer_tensors(engine: Any) -> dict[str, torch.Tensor]:
    """This rank's optimizer tensors (a ZeRO partition's base optimizer and master weights;
    under ZeRO-3 also the bit16 partitions the parameters' ``ds_tensor`` view, and the
    module's buffers, each rank's own)."""
    o = engine.optimizer
    base = getattr(o, "optimizer", o)
    out: dict[str, torch.Tensor] = {}
    if engine.zero_optimization_stage() == 3:  # the base optimizer's groups are empty here
        for i, flat in enumerate(o.fp32_partitioned_groups_flat):
            group = o.fp16_groups[i]
            for k, v in base.state[flat].items():
                out[f"{i}/{k}"] = unpadded(v, group) if v.shape == flat.shape else v.clone()
            out[f"fp32/{i}"] = unpadded(flat, group)
            out[f"bit16/{i}"] = unpadded(o.fp16_partitioned_groups_flat[i], group)
        for k, v in engine.module.named_buffers():
            out[f"buffer/{k}"] = v.detach().clone().reshape(-1)
        return out
    for pid, st in base.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{pid}/{k}"] = v.detach().clone().reshape(-1)
    for i, t in enumerate(getattr(o, "single_partition_of_fp32_groups", [])):
        out[f"fp32/{i}"] = t.detach().clone()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=["ciuic", "ds"], default="ciuic")
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--generator", action="store_true")
    p.add_argument("--batchnorm", action="store_true")
    p.add_argument("--step-first", action="store_true")
    a = p.parse_args()
    out = Path(a.out)
    deepspeed.init_distributed(dist_backend="gloo")
    # one thread: a loaded machine can make a multi-threaded kernel sum in another order (seen:
    # last-bit differences in one slow-suite run in the clean-clone CI)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    norm: list[nn.Module] = [nn.BatchNorm1d(32)] if a.batchnorm else []
    model = nn.Sequential(nn.Linear(8, 32), *norm, nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": a.accumulate,
              "zero_optimization": {"stage": a.stage}, "steps_per_print": 10_000,
              "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched,
                                           config=config)
    sampler = DistributedSampler(Noisy(48), shuffle=True, seed=1)
    loader = DataLoader(Noisy(48), batch_size=4, sampler=sampler)
    if a.generator:
        half = Subset(Noisy(48), range(dist.get_rank(), 48, dist.get_world_size()))
        loader = DataLoader(half, batch_size=4, shuffle=True, generator=torch.Generator())
    first_epoch, skip = 0, 0
    snapshots: Any = None
    if a.mode == "ciuic":
        from ciuic.integrations.deepspeed import DeepSpeedSnapshots

        snapshots = DeepSpeedSnapshots(engine, "tests", job="ds", store=out / "store",
                                       save_interval=a.every, loaders=[loader],
                                       handle_signals=False)
        if a.step_first:  # a used engine: ZeRO-3 keeps its small parameters gathered after
            loss = nn.functional.cross_entropy(engine(torch.zeros(4, 8)),  # a step
                                               torch.zeros(4, dtype=torch.long))
            engine.backward(loss)
            engine.step()
        first_epoch = snapshots.restore()
    elif (out / "ds" / "latest").exists():
        engine.load_checkpoint(str(out / "ds"))
        per_epoch = len(loader) // a.accumulate
        first_epoch, done = divmod(engine.global_steps, per_epoch)
        skip = done * a.accumulate
        if dist.get_rank() == 0:
            print(f"Resuming the DeepSpeed loop at global step {engine.global_steps}",
                  file=sys.stderr)
    for epoch in range(first_epoch, a.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch == first_epoch and i < skip:
                continue  # the batches trained before the checkpoint
            loss = nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            if snapshots is not None:
                snapshots.step(loss=loss.item())
            elif (i + 1) % a.accumulate == 0 and engine.global_steps % a.every == 0:
                engine.save_checkpoint(str(out / "ds"), tag=f"step_{engine.global_steps}")
            if engine.global_steps == a.kill_at and (i + 1) % a.accumulate == 0:
                if snapshots is not None:
                    snapshots.manager.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    if snapshots is not None:
        snapshots.finish()
        snapshots.close()
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, optimizer_tensors(engine))
    # ZeRO-3: the full parameters gathered from every rank's partition (a collective)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()),
                                           enabled=a.stage == 3):
        module = {f"model/{k}": v.detach().clone().contiguous()
                  for k, v in engine.module.state_dict().items()}
    if dist.get_rank() == 0:
        tensors = dict(module)
        for r, part in enumerate(parts):
            tensors |= {f"optimizer/rank{r}/{k}": v.contiguous() for k, v in part.items()}
        tensors["lr"] = torch.tensor(engine.lr_scheduler.get_last_lr(), dtype=torch.float64)
        save_file(tensors, str(out / f"final-{a.mode}.safetensors"))
        print(f"GLOBAL_STEP {engine.global_steps} SAMPLES {engine.global_samples}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())  # not sys.exit: see tests/helpers/leave.py
