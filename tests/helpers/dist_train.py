"""A deterministic multi-rank training job for the torchrun tests (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node 2 tests/helpers/dist_train.py \
        --store DIR --out DIR --mode ddp|fsdp|hsdp --steps 12 [--save-every 4] [--kill-rank 1 ...]

Each rank writes ``OUT/rank<r>.json``: where it started, its manager's stats, and the full
(unsharded) model and optimizer state's digest plus (``--dump``) the full tensors in
``OUT/full.pt`` (rank 0). Rank-specific failpoints: ``CIUIC_FAILPOINTS_RANK<r>``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import torch
import torch.distributed as dist
from leave import leave  # beside this script
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.utils.data import DataLoader, TensorDataset

from ciuic import ResumableSampler, SnapshotManager, faults
from ciuic.state.capture import capture


def build(mode: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model: nn.Module = nn.Sequential(nn.Linear(16, 37), nn.ReLU(), nn.Dropout(0.2),
                                     nn.Linear(37, 5))
    if mode in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # hsdp: 2 replicas, each sharded over half the ranks (each box held by 2 ranks)
        mesh = (init_device_mesh("cpu", (world,)) if mode == "fsdp" else
                init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return model, optimizer


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the unsharded model and optimizer state, by name (rank 0 has them)."""
    msd, osd = get_state_dict(model, optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {f"model/{k}": v for k, v in msd.items()}
    for fqn, st in osd.get("state", {}).items():
        for k, v in st.items():
            out[f"optimizer/{fqn}/{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def digest(state: dict[str, torch.Tensor]) -> str:
    h = blake3.blake3()
    for k, v in sorted(state.items()):
        h.update(k.encode() + v.detach().contiguous().view(-1).view(torch.uint8).numpy()
                 .tobytes())
    return h.hexdigest()


def epochs(loader: DataLoader[Any], sampler: ResumableSampler) -> Iterator[Any]:
    """A loop written for DistributedSampler: set_epoch at each epoch's start (after a restore,
    from the snapshot's epoch, which it finishes)."""
    for epoch in itertools.count(sampler.epoch):
        sampler.set_epoch(epoch)
        yield from loader


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--job", default="dist")
    p.add_argument("--mode", default="ddp", choices=["ddp", "fsdp", "hsdp"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--no-snapshots", action="store_true")
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--signal-rank", type=int, default=None)
    p.add_argument("--signal-at", type=int, default=None)
    p.add_argument("--dump", action="store_true", help="rank 0 writes the full state to full.pt")
    p.add_argument("--overlap", action="store_true", help="SnapshotManager(overlap=True)")
    p.add_argument("--time-interval", type=float, default=None)
    p.add_argument("--odd-lr", action="store_true", help="rank 1 uses another learning rate")
    p.add_argument("--store-per-rank", action="store_true",
                   help="a misconfiguration: each rank its own directory")
    p.add_argument("--split", action="store_true",
                   help="64 samples split between the ranks (ResumableSampler's num_replicas "
                        "and rank), epochs through set_epoch; each rank reports its indices")
    p.add_argument("--mispredict-rank", type=int, default=None,
                   help="this rank predicts it writes no replica (the plan disagrees)")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = os.environ.get(f"CIUIC_FAILPOINTS_RANK{rank}")
    if spec:
        faults.reload(spec)
    model, optimizer = build(a.mode, world)
    if rank == a.mispredict_rank:
        import ciuic.manager.ranked

        ciuic.manager.ranked.predicted_owned = lambda *_: set()  # type: ignore[assignment]
    if a.odd_lr and rank == 1:
        optimizer.param_groups[0]["lr"] = 2e-2
    g = torch.Generator().manual_seed(1234)
    n = 64 if a.split else 256
    data = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 5, (n,), generator=g),
                         torch.arange(n))
    sampler = (ResumableSampler(data, shuffle=True, seed=100, num_replicas=world, rank=rank)
               if a.split else  # the ranks' shares of one order, as DistributedSampler's
               ResumableSampler(data, shuffle=True, seed=100 + rank))  # each rank its own order
    loader = DataLoader(data, batch_size=8, sampler=sampler, generator=torch.Generator())
    torch.manual_seed(1000 + rank)  # per-rank dropout masks: the per-rank RNG must come back
    manager = None
    start = 0
    first_staged = 0
    store = f"{a.store}-{rank}" if a.store_per_rank else a.store
    if not a.no_snapshots:
        manager = SnapshotManager("tests", job=a.job, store=store, save_interval=a.save_every,
                                  overlap=a.overlap, time_interval_s=a.time_interval)
        last = manager.restore(model, optimizer, sampler=sampler)
        start = 0 if last is None else last + 1
    batches = epochs(loader, sampler) if a.split else iter(loader)
    seen: list[int] = []
    for step in range(start, a.steps):
        x, y, index = next(batches)
        seen += index.tolist()
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if rank == a.signal_rank and step == a.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # only this rank gets it
        if manager is not None:
            manager.step(step, model, optimizer, sampler=sampler, loss=loss.item())
            if manager.stats.snapshots + manager.stats.failures == 0:
                first_staged = manager.stats.last_staged_bytes
        if rank == a.kill_rank and step == a.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    if manager is not None:
        manager.wait()
    state = full_state(model, optimizer)
    report: dict[str, Any] = {"rank": rank, "world": world, "start": start, "seen": seen,
                              "digest": digest(state) if rank == 0 else None}
    if manager is not None:
        s = manager.stats
        report |= {"snapshots": s.snapshots, "failures": s.failures, "last_error": s.last_error,
                   "bytes_new": s.bytes_new, "bytes_written": s.bytes_written,
                   "restored_step": manager.restored.step if manager.restored else None,
                   "first_staged": first_staged, "last_staged": s.last_staged_bytes,
                   "restore_parts": list(s.restore_parts),
                   # plans made from every rank's metas (a restored plan is adopted)
                   "plans_made": manager._pipeline.plans().made,
                   # of them, from every rank's metas (not by rule)
                   "plans_exchanged": manager._pipeline.plans().exchanged,
                   # what a snapshot copies of this rank's own state (RNG, sampler)
                   "own_bytes": sum(leaf.nbytes for leaf in capture(
                       None, None, {"sampler": sampler, "loss": 0.0}).leaves),
                   "replica_bytes": sum(t.numel() * t.element_size() for t in [
                       *model.state_dict().values(),
                       *(v for st in optimizer.state.values() for v in st.values()
                         if isinstance(v, torch.Tensor))])}
        manager.close()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.dump and rank == 0:
        torch.save(state, out / "full.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())  # not sys.exit: see tests/helpers/leave.py
