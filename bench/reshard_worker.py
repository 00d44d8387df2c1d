"""One rank of a restart on another world size (``bench/scale.py --chain``; gloo, CPU).

    torchrun --nproc-per-node W bench/reshard_worker.py --store DIR --out DIR --mode fsdp|tp
        --step N [--restore] [--expect FILE]

The model: four linear layers (48 -> 200 -> 48 -> 120 -> 48) and AdamW. ``fsdp``: FSDP2 over
all W ranks (every tensor's rows cut W ways, unevenly). ``tp``: tensor parallel over pairs of
ranks (the first and third layers column-wise, the others row-wise: their biases replicated on
the pair) under FSDP2 over the W / 2 pairs, the layout torchtitan gives Llama (FSDP2 over TP
shards a column-wise weight's rows on both mesh dimensions: ``_StridedShard``).

With ``--restore`` the rank first restores the job's latest snapshot (written on another world
size) and rank 0 compares every tensor of the whole model and optimizer state with ``--expect``
(what the writing run dumped): equal, bit for bit, or the run fails. Then every rank takes one
training step and snapshots it at ``--step``; rank 0 dumps the whole state to
``OUT/full.pt`` for the next run. Rank 0 writes ``OUT/result.json``: each rank's restore wall
and CPU seconds, the parts of the body it read, its save's wall and CPU seconds, the plans it
made and how many from every rank's metas, and its peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers.leave import leave  # how a torchrun job script ends


def build(mode: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 200), nn.ReLU(), nn.Linear(200, 48), nn.ReLU(),
                          nn.Linear(48, 120), nn.ReLU(), nn.Linear(120, 48))
    if mode == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(),
                                               "4": ColwiseParallel(), "6": RowwiseParallel()})
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)  # one batch on every rank (TP pairs need it)
    x, y = torch.randn(16, 48, generator=g), torch.randn(16, 48, generator=g)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def whole(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the whole (unsharded) model and optimizer state, on rank 0."""
    msd, osd = get_state_dict(model, opt,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {f"model/{k}": v for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():  # (empty on the other ranks)
        for k, v in st.items():
            out[f"optimizer/{fqn}/{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=["fsdp", "tp"], default="fsdp")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--restore", action="store_true")
    p.add_argument("--expect", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from ciuic import SnapshotManager

    model, opt = build(a.mode, world)
    train(model, opt, 0)  # the optimizer's state exists, as in any run past its first step
    m = SnapshotManager("bench", job=f"reshard-{a.mode}", store=a.store, handle_signals=False)
    mine: dict[str, Any] = {"rank": rank}
    if a.restore:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        restored = m.restore(model, opt)
        mine["restore_s"] = [time.perf_counter() - t0, time.process_time() - c0]
        mine["restored"] = restored
        mine["parts"] = list(m.stats.restore_parts)
        state = whole(model, opt)
        if rank == 0 and a.expect is not None:
            want = torch.load(a.expect, weights_only=True)
            differ = sorted(k for k in set(want) | set(state)
                            if k not in want or k not in state
                            or not torch.equal(want[k], state[k]))
            mine["compared"] = len(want)
            mine["differ"] = differ
    train(model, opt, a.step)
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    m.save(a.step, model, opt)
    mine["save_s"] = [time.perf_counter() - t0, time.process_time() - c0]
    plans = m._pipeline.plans()  # type: ignore[attr-defined]
    mine["plans"] = [plans.made, plans.exchanged]
    state = whole(model, opt)
    m.close()
    a.out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        torch.save(state, a.out / "full.pt")
    mine["max_rss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        (a.out / "result.json").write_text(json.dumps({"world": world, "mode": a.mode,
                                                       "ranks": everyone}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)  # not a return to the interpreter: see tests/helpers/leave.py
