"""The training job of bench/goodput.py (see there): a DDP job (gloo, CPU) that trains until it
is killed, with the checkpointing of one of the systems compared:

- ``--mode ciuic``: a :class:`~ciuic.SnapshotManager` (asynchronous, every ``--every`` steps),
  the training function wrapped in :func:`ciuic.recoverable`: recovered in its process under
  ``ciuic run --nproc-per-node``, called once (and the job restarted whole) under ``ciuic run
  -- torchrun``;
- ``--mode dcp``: ``torch.distributed.checkpoint.save`` every ``--every`` steps (the state of
  ``get_state_dict``, one folder per checkpoint, the latest named in a file written after a
  barrier), loaded at the start, as torchtitan's checkpointer does;
- ``--mode none``: no checkpoint (the ideal step time);
- ``--mode torchft``: torchft's fault-tolerant DDP over replica groups (``train_torchft``).

A rank takes a fault when bench/goodput.py writes ``DIR/fault-RANK`` (``raise`` or ``hang``, at
its next step; it renames the file to take it once); kills come from outside, by the pid in
``DIR/pid-RANK``. Rank 0 appends ``TIME STEP PID.GENERATION`` to ``DIR/steps.log`` after each
step. Each step sleeps ``--step-s`` (the accelerator's compute, which the VM's 2 cores cannot
give 2+ ranks).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ciuic


def build(hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 16))


def fault(path: Path, rank: int) -> None:
    """Take the fault bench/goodput.py asked this rank for, once."""
    flag = path / f"fault-{rank}"
    if not flag.exists():
        return
    taken = flag.with_suffix(f".{os.getpid()}")
    try:
        os.rename(flag, taken)
    except FileNotFoundError:
        return
    kind = taken.read_text().strip()
    if kind == "hang":
        time.sleep(10**6)
    raise RuntimeError(f"injected fault on rank {rank}")


class DcpCheckpoint:
    """torchrun + DCP, as torchtitan checkpoints: the state of ``get_state_dict``, saved
    synchronously into one folder per step; the latest named after every rank wrote."""

    def __init__(self, folder: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.folder, self.model, self.opt = folder, model, opt
        self.latest = folder / "latest"

    def state(self) -> dict[str, object]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def load(self) -> int | None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if not self.latest.exists():
            return None
        step = int(self.latest.read_text())
        state = self.state()
        dcp.load(state, checkpoint_id=str(self.folder / f"step-{step}"))
        set_state_dict(self.model, self.opt, model_state_dict=state["model"],  # type: ignore[arg-type]
                       optim_state_dict=state["optim"])  # type: ignore[arg-type]
        return step

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state(), checkpoint_id=str(self.folder / f"step-{step}"))
        dist.barrier()
        if dist.get_rank() == 0:
            old = int(self.latest.read_text()) if self.latest.exists() else None
            tmp = self.latest.with_suffix(".tmp")
            tmp.write_text(str(step))
            os.replace(tmp, self.latest)
            if old is not None:
                import shutil

                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)


@ciuic.recoverable
def train(a: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    rank = dist.get_rank()
    torch.set_num_threads(1)
    (a.dir / f"pid-{rank}").write_text(str(os.getpid()))
    model = nn.parallel.DistributedDataParallel(build(a.hidden))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    log = (a.dir / "steps.log").open("a") if rank == 0 else None
    # which life of rank 0 made a step: a new process, or a new generation in the same one
    life = f"{os.getpid()}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def one(step: int) -> None:
        fault(a.dir, rank)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, 256, generator=g), torch.randint(0, 16, (32,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(a.step_s)

    def logged(step: int) -> None:
        if log is not None:
            log.write(f"{time.time():.4f} {step} {life}\n")
            log.flush()

    if a.mode == "ciuic":
        with ciuic.SnapshotManager("goodput", job="bench", store=a.dir / "store",
                                   save_interval=a.every) as manager:
            last = manager.restore(model, opt)
            step = 0 if last is None else last + 1
            while True:
                one(step)
                manager.step(step, model, opt)
                logged(step)
                step += 1
    ckpt = DcpCheckpoint(a.dir / "dcp", model, opt) if a.mode == "dcp" else None
    last = ckpt.load() if ckpt is not None else None
    step = 0 if last is None else last + 1
    while True:
        one(step)
        if ckpt is not None and step % a.every == 0 and step:
            ckpt.save(step)
        logged(step)
        step += 1


def train_torchft(a: argparse.Namespace) -> None:
    """torchft's DDP across replica groups of one rank each (its lighthouse started by
    bench/goodput.py, each group under its own torchrun): a lost group is left out of the
    quorum while the others go on, and heals from a peer when it is back. Each group logs
    ``TIME STEP LIFE BATCHES PARTICIPANTS`` (batches committed by every group so far)."""
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    replica = int(os.environ["REPLICA_GROUP_ID"])
    torch.set_num_threads(1)
    (a.dir / f"pid-{replica}").write_text(str(os.getpid()))
    m = build(a.hidden)
    inner = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def load(sd: dict[str, object]) -> None:
        m.load_state_dict(sd["model"])  # type: ignore[arg-type]
        inner.load_state_dict(sd["optim"])  # type: ignore[arg-type]

    def save() -> dict[str, object]:
        return {"model": m.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=a.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
                      load_state_dict=load, state_dict=save, replica_id=f"goodput_{replica}",
                      timeout=timeout)
    model = DistributedDataParallel(manager, m)
    opt = Optimizer(manager, inner)
    log = (a.dir / ("steps.log" if replica == 0 else f"steps-{replica}.log")).open("a")
    life = f"{os.getpid()}.0"
    while True:
        fault(a.dir, replica)
        step = manager.current_step()
        g = torch.Generator().manual_seed(1000 * step + replica)
        x, y = torch.randn(32, 256, generator=g), torch.randint(0, 16, (32,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        time.sleep(a.step_s)
        log.write(f"{time.time():.4f} {manager.current_step() - 1} {life} "
                  f"{manager.batches_committed()} {manager.num_participants()}\n")
        log.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--mode", choices=["ciuic", "dcp", "none", "torchft"], required=True)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="the collectives' timeout (gloo's default: 1800 s)")
    a = p.parse_args()
    if a.mode == "torchft":
        train_torchft(a)
    else:
        train(a)


if __name__ == "__main__":
    main()
