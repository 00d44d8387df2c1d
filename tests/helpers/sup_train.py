"""A deterministic training job for the ``ciuic run`` tests: one process, or DDP ranks under
torchrun (gloo, CPU), with faults that strike on a given start of the supervisor.

    ciuic run -- python tests/helpers/sup_train.py --store DIR --out DIR --steps 20 \
        [--kill-at STEP:START[:RANK]] [--hang-at STEP:START[:RANK]] [--fail-start]

``START`` is ``CIUIC_RUN_RESTART`` (0: the first start). A kill is a SIGKILL of the rank itself
after the optimizer update of STEP and before its ``step()``; a hang sleeps there. At the end
rank 0 writes every model and optimizer tensor to ``OUT/final-ciuic.safetensors``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from leave import leave  # beside this script
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finalstate import write_final

from ciuic import ResumableSampler, SnapshotManager


def fault(spec: str | None, step: int, rank: int) -> bool:
    if not spec:
        return False
    parts = [int(x) for x in spec.split(":")]
    at, start = parts[0], parts[1]
    who = parts[2] if len(parts) > 2 else 0
    return (step == at and int(os.environ.get("CIUIC_RUN_RESTART", "0")) == start
            and rank == who)


def once(spec: str | None, step: int, rank: int) -> bool:
    """A fault at STEP on RANK that strikes once, whatever restarted the job: while FILE does
    not exist yet (it is made when it strikes)."""
    if not spec:
        return False
    at, who, marker = spec.split(":", 2)
    if step != int(at) or rank != int(who) or Path(marker).exists():
        return False
    Path(marker).touch()
    return True


def dump(model: nn.Module, opt: torch.optim.Optimizer, rank: int, to: Path) -> None:
    """An FSDP2 job's whole model and optimizer state, gathered (every rank calls it), to
    ``to`` (rank 0 writes it)."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    if rank == 0:
        tensors = {f"model/{k}": v.contiguous() for k, v in msd.items()}
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                tensors[f"optimizer/{fqn}/{k}"] = v.contiguous().reshape(-1)
        to.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(to))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--endpoint", help="a ciuic server instead of the store (CIUIC_API_KEY)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--kill-at")
    p.add_argument("--hang-at")
    p.add_argument("--pause-at", metavar="STEP:RANK:FILE",
                   help="hang there once: only while FILE does not exist yet (it is made)")
    p.add_argument("--kill-once", metavar="STEP:RANK:FILE",
                   help="SIGKILL there once: only while FILE does not exist yet (it is made)")
    p.add_argument("--raise-once", metavar="STEP:RANK:FILE",
                   help="raise an exception there once (a bug in the training code)")
    p.add_argument("--fail-start", action="store_true")
    p.add_argument("--sync", action="store_true", help="asynchronous=False")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--model", choices=["ddp", "fsdp2"], default="ddp",
                   help="under torchrun: DDP replicas, or FSDP2 shards (fully_shard)")
    p.add_argument("--data", type=int, default=0, metavar="N",
                   help="batches of 4 from a data set of N samples, split between the ranks "
                        "(ResumableSampler); each rank writes the indices it trained on at "
                        "each step to OUT/seen-w<ranks>-<start>-<rank>.json")
    p.add_argument("--dump", action="store_true",
                   help="FSDP2: the whole state to OUT/at-<step>-w<ranks>.safetensors at each "
                        "snapshot, and to OUT/restored-<step>-w<ranks>.safetensors after a restore")
    a = p.parse_args()
    if a.fail_start:
        raise RuntimeError("the data set is not mounted (injected start-up failure)")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    # one thread: a loaded machine can make a multi-threaded kernel split its sums another way
    # (seen: one run in five beside the test suite differed in the last bits from step 0 on)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(64, a.hidden), nn.ReLU(), nn.Dropout(0.1),
                                     nn.Linear(a.hidden, 4))
    if world > 1 and a.model == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = SnapshotManager("sup", store=None if a.endpoint else a.store,
                              endpoint=a.endpoint, save_interval=a.every,
                              asynchronous=not a.sync)
    extras: dict[str, Any] = {}
    if a.data:
        a.out.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(7)
        samples = torch.randn(a.data, 64, generator=g), torch.randint(0, 4, (a.data,), generator=g)
        sampler = ResumableSampler(a.data, seed=3, num_replicas=world, rank=rank)
        extras["sampler"] = sampler
        indices = (i for _ in itertools.count() for i in sampler)  # epoch after epoch
        batches = ([next(indices) for _ in range(4)] for _ in itertools.count())
    last = manager.restore(model, opt, **extras)
    start = 0 if last is None else last + 1
    if a.dump and last is not None:
        dump(model, opt, rank, a.out / f"restored-{last}-w{world}.safetensors")
    seen: dict[int, list[int]] = {}
    # this start of the workers: ciuic run's restarts, torchrun's own
    started = "-".join(os.environ.get(v, "0") for v in ("CIUIC_RUN_RESTART",
                                                         "TORCHELASTIC_RESTART_COUNT"))
    longest = 0.0
    for step in range(start, a.steps):
        if a.data:
            index = next(batches)
            seen[step] = index
            x, y = samples[0][index], samples[1][index]
            (a.out / f"seen-w{world}-{started}-{rank}.json").write_text(
                json.dumps({"world": world, "seen": seen}))
        else:
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if fault(a.kill_at, step, rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if once(a.pause_at, step, rank):
            print(f"pausing at step {step} (rank {rank})", file=sys.stderr, flush=True)
            time.sleep(3600)
        if once(a.kill_once, step, rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if once(a.raise_once, step, rank):
            raise ValueError(f"injected failure at step {step} (rank {rank})")
        if fault(a.hang_at, step, rank):
            print(f"hanging at step {step} (rank {rank})", file=sys.stderr, flush=True)
            time.sleep(3600)
        if a.step_sleep:
            time.sleep(a.step_sleep)
        if manager.step(step, model, opt, **extras):
            longest = max(longest, manager.stats.last_save_s)
            if a.dump:
                dump(model, opt, rank, a.out / f"at-{step}-w{world}.safetensors")
    manager.close()
    print(f"longest snapshot: {longest:.2f} s", file=sys.stderr)
    if a.model == "fsdp2" and world > 1:  # every rank takes part in gathering the shards
        dump(model, opt, rank, a.out / "final-ciuic.safetensors")
    elif rank == 0:
        a.out.mkdir(parents=True, exist_ok=True)
        write_final(model.module if world > 1 else model, opt, a.out / "final-ciuic.safetensors")
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)  # not a return to the interpreter: see tests/helpers/leave.py
