"""One rank of bench/ds_stall.py (run under torchrun): train a GPT-like MLP stack under a
DeepSpeed engine, snapshot it every few steps with ``engine.save_checkpoint`` or with
DeepSpeedSnapshots, and report the stall of each snapshot step."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from torch import nn


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["ds", "ciuic"], required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--json", required=True)
    a = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(a.layers):
        layers += [nn.Linear(a.width, a.width), nn.GELU()]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": a.stage},
              "steps_per_print": 10_000}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    snapshots = None
    if a.mode == "ciuic":
        from ciuic.integrations.deepspeed import DeepSpeedSnapshots

        snapshots = DeepSpeedSnapshots(engine, "bench", job="ds", store=Path(a.dir) / "store",
                                       save_interval=a.every, handle_signals=False,
                                       compression="off")
    step_times: list[float] = []
    stalls: list[float] = []
    x = torch.randn(8, a.width)
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        t1 = time.perf_counter()
        if snapshots is not None:
            snapshots.step()
        elif engine.global_steps % a.every == 0:
            engine.save_checkpoint(str(Path(a.dir) / "ds"), tag=f"s{engine.global_steps}")
        t2 = time.perf_counter()
        step_times.append(t1 - t0)
        if engine.global_steps % a.every == 0:
            stalls.append(t2 - t1)
    t0 = time.perf_counter()
    if snapshots is not None:
        snapshots.manager.wait()
    drain = time.perf_counter() - t0
    if snapshots is not None:
        snapshots.close()
    params = sum(p.numel() for p in model.parameters())
    out = {"mode": a.mode, "stage": a.stage, "params": params, "stalls": stalls[1:],
           "first_stall": stalls[0], "step_median": statistics.median(step_times),
           "drain": drain}
    parts: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, out)
    if dist.get_rank() == 0:
        Path(a.json).write_text(json.dumps(parts))
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
