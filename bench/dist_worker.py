"""One rank of the multi-rank benchmark (run by ``bench/dist.py`` under torchrun; gloo, CPU).

Builds an FSDP2-sharded stack of d=1024 MLP blocks with Adam state (``--mib`` MiB of state in
total, rounded to whole blocks of 96 MiB, split across the ranks), then per round, interleaved
and in alternating order: ``dcp.save`` (+ fsync of its files) and ciuic ``save()`` (synchronous,
into a fresh store: a full snapshot, committed); then ``dcp.load`` into the live state dict (+
``set_state_dict``) and ciuic ``restore()`` (a new manager, as a restarted job; created outside
the timed part, as is the manager that saves). Every timing is the slowest rank's (a barrier
before and after). Rank 0 writes the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from run import drop_caches, fsync_tree  # bench/run.py
from torch import nn


def build(mib: int, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    d = 1024
    layers = max(1, round(mib * 2**20 / (3 * 4 * 2 * d * 4 * d)))  # params + 2 Adam moments
    model = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.Linear(4 * d, d))
                            for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(2, d)).sum().backward()
    opt.step()
    return model, opt


def timed(fn: Callable[[int], None], r: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(r)
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ciuic import SnapshotManager

    model, opt = build(a.mib, world)
    times: dict[str, list[float]] = {"dcp.save": [], "ciuic.save": [], "dcp.load": [],
                                     "ciuic.restore": []}
    nbytes = sum(p.to_local().numel() * 4 * 3 for p in model.parameters())  # type: ignore
    total = torch.tensor([nbytes])
    dist.all_reduce(total)

    def dcp_save(r: int) -> None:
        msd, osd = get_state_dict(model, opt)
        path = a.dir / f"dcp-{r}"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
        fsync_tree(path)

    def dcp_load(r: int) -> None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(a.dir / f"dcp-{r}"))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    managers: dict[int, SnapshotManager] = {}

    def ciuic_save(r: int) -> None:  # a fresh store per round: a full snapshot, no dedup
        managers[r].save(1, model, opt)

    def ciuic_restore(r: int) -> None:
        managers[r].restore(model, opt)

    def open_manager(r: int) -> None:  # outside the timed part, as a training job does it
        if r in managers:
            managers.pop(r).close()
        managers[r] = SnapshotManager("bench", job="dist", store=a.dir / f"ciuic-{r}",
                                      handle_signals=False, asynchronous=False)

    for r in range(a.rounds):
        open_manager(r)
        saves = [("dcp.save", dcp_save), ("ciuic.save", ciuic_save)]
        loads = [("dcp.load", dcp_load), ("ciuic.restore", ciuic_restore)]
        for name, fn in (saves if r % 2 == 0 else saves[::-1]):
            times[name].append(timed(fn, r))
        open_manager(r)  # a restarted job: a new manager restores
        if rank == 0:
            drop_caches()
        for name, fn in (loads if r % 2 == 0 else loads[::-1]):
            times[name].append(timed(fn, r))
    for m in managers.values():
        m.close()
    # the per-step agreement: time inside step() when no snapshot is due, between "training
    # steps" of 10 ms (a sleep: the CPU is free, as it mostly is while a GPU computes)
    with SnapshotManager("bench", job="steps", store=a.dir / "steps", save_interval=10**9,
                         handle_signals=False) as m:
        m.step(1, model, opt)  # the first step() checks for an unrestored job; not timed
        dist.barrier()
        inside = 0.0
        for i in range(2, 202):
            time.sleep(0.01)
            t0 = time.perf_counter()
            m.step(i, model, opt)
            inside += time.perf_counter() - t0
        step_us = inside / 200 * 1e6
    if rank == 0:
        a.out.write_text(json.dumps({"world": world, "state_bytes": int(total.item()),
                                     "times": times, "step_us": step_us}))
        shutil.rmtree(a.dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
