"""A deterministic DDP or FSDP2 job (gloo, CPU) for in-process recovery under ``ciuic run
--nproc-per-node`` (tests/test_inprocess.py), its training function wrapped in
``ciuic.recoverable``, with faults at any point of a step:

    ciuic run --nproc-per-node 4 -- python tests/helpers/ip_train.py --store DIR --out DIR \
        [--fault STEP:RANK:PHASE:ACTION ...]

PHASE is where in the step: ``forward``, ``backward`` (in the backward, before the gradients
are reduced), ``allreduce`` (inside DDP's gradient allreduce, or FSDP2's reduce-scatter),
``optimizer`` (in the optimizer's step), ``snapshot`` (in the background write of the snapshot
that step takes), ``after`` (before ``step()``) or ``end`` (after training, the
function's last line: STEP is the last step). ACTION is ``kill`` (SIGKILL), ``raise`` or
``hang``, each striking once (a marker file in OUT), or ``bug`` (a TypeError) or ``config`` (a
ConfigurationError), every time. ``--device cuda``: NCCL, one GPU a rank, DDP (its abort's
path on a GPU, tests/test_cuda_inprocess.py). Each rank
appends ``{"step", "time", "pid", "gen"}`` to OUT/steps-RANK.jsonl after each step(), and a
fault's rank writes OUT/fault-STEP-RANK.json with its time just before it strikes. At the end rank 0
writes every model and optimizer tensor to OUT/final-ciuic.safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from leave import leave  # beside this script
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finalstate import write_final, write_final_gathered

import ciuic
from ciuic import SnapshotManager, faults

PHASES = ("forward", "backward", "allreduce", "optimizer", "snapshot", "after", "end")


class Faults:
    def __init__(self, specs: list[str], out: Path, rank: int) -> None:
        self.out, self.rank = out, rank
        self.specs = []
        for s in specs:
            step, who, phase, action = s.split(":")
            if phase not in PHASES or action not in ("kill", "raise", "hang", "bug", "config"):
                raise SystemExit(f"--fault {s}: PHASE one of {PHASES}, ACTION "
                                 "kill/raise/hang/bug/config")
            if int(who) == rank:
                self.specs.append((int(step), phase, action))
        self.step = -1

    def strike(self, phase: str) -> None:
        for step, ph, action in self.specs:
            if step != self.step or ph != phase:
                continue
            marker = self.out / f"fault-{step}-{self.rank}.json"
            if action == "bug":  # a bug in the training code: every time
                raise TypeError(f"a bug at step {step}, {phase} (rank {self.rank})")
            if action == "config":  # bad input, which ciuic says: every time
                raise ciuic.ConfigurationError(f"bad input at step {step} (rank {self.rank})")
            if marker.exists():
                continue
            marker.write_text(json.dumps({"time": time.time(), "phase": phase,
                                          "action": action, "pid": os.getpid()}))
            print(f"injected {action} at step {step}, {phase} (rank {self.rank})",
                  file=sys.stderr, flush=True)
            if phase == "snapshot":  # the writer thread's next chunk write
                faults.reload(f"chunk.put={action if action != 'hang' else 'sleep:3600'}")
                return
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "hang":
                time.sleep(3600)
            raise ValueError(f"injected failure at step {step}, {phase} (rank {self.rank})")


@ciuic.recoverable
def train(a: argparse.Namespace) -> None:
    cuda = a.device == "cuda"
    if cuda:  # NCCL: what its abort does to a communicator in flight (one GPU a rank)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.use_deterministic_algorithms(True)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    f = Faults(a.fault, a.out, rank)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(64, a.hidden), nn.ReLU(), nn.Dropout(0.1),
                                     nn.Linear(a.hidden, 4))
    model[0].register_forward_pre_hook(lambda *_: f.strike("forward"))
    # the gradient of the first layer's output: in the backward, before its gradients are
    # reduced (a hook on a parameter does not run under FSDP2, whose shards get their
    # gradients from its reduce-scatter)
    model[0].register_forward_hook(
        lambda m, i, out: (out.register_hook(lambda g: (f.strike("backward"), g)[1]), None)[1])
    if a.model == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model[0].register_full_backward_hook(lambda *_: f.strike("allreduce"))
    else:
        model = nn.parallel.DistributedDataParallel(
            model.cuda() if cuda else model,
            device_ids=[torch.cuda.current_device()] if cuda else None)

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotations
            f.strike("allreduce")
            work = dist.all_reduce(bucket.buffer(), async_op=True)
            assert work is not None
            return work.get_future().then(lambda fut: fut.value()[0] / world)

        model.register_comm_hook(None, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.register_step_pre_hook(lambda *_: f.strike("optimizer"))
    log = (a.out / f"steps-{rank}.jsonl").open("a")
    with SnapshotManager("ip", store=a.store, save_interval=a.every) as manager:
        last = manager.restore(model, opt)
        for step in range(0 if last is None else last + 1, a.steps):
            f.step = step
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 4, (16,), generator=g)
            if cuda:
                x, y = x.cuda(), y.cuda()
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            f.strike("after")
            if step % a.every == 0:
                f.strike("snapshot")
            manager.step(step, model, opt)
            log.write(json.dumps({"step": step, "time": time.time(), "pid": os.getpid(),
                                  "gen": gen}) + "\n")
            log.flush()
            if a.step_sleep:
                time.sleep(a.step_sleep)
    if a.model == "fsdp2":
        write_final_gathered(model, opt, a.out / "final-ciuic.safetensors", rank == 0)
    elif rank == 0:
        write_final(model.module, opt, a.out / "final-ciuic.safetensors")
    f.strike("end")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--model", choices=["ddp", "fsdp2"], default="ddp")
    p.add_argument("--fault", action="append", default=[], metavar="STEP:RANK:PHASE:ACTION")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: NCCL, one GPU a rank (DDP only)")
    p.add_argument("--unwrapped", action="store_true",
                   help="call the training function itself, not through ciuic.recoverable")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    (train.__wrapped__ if a.unwrapped else train)(a)  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
    leave(0)  # not a return to the interpreter: see tests/helpers/leave.py
