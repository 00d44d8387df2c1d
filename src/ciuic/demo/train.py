"""The demo's training script: a char-level GPT on the shipped corpus, snapshotted by ciuic.

Run by ``ciuic demo`` in subprocesses (``python -m ciuic.demo.train ...``); it can also be run by
hand. ``--kill-at STEP`` makes it SIGKILL itself right after that step's update.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from importlib import resources
from pathlib import Path

import blake3
import torch
from torch.utils.data import DataLoader, Dataset

from ciuic.demo import SAVE_EVERY
from ciuic.demo.model import CharGPT, GPTConfig
from ciuic.manager import SnapshotManager
from ciuic.state.data import ResumableSampler


def corpus() -> str:
    return resources.files("ciuic.demo").joinpath("corpus.txt").read_text(encoding="ascii")


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Every (input, next-character target) window of the corpus."""

    def __init__(self, data: torch.Tensor, block: int) -> None:
        self.data, self.block = data, block

    def __len__(self) -> int:
        return len(self.data) - self.block - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i:i + self.block + 1]
        return chunk[:-1], chunk[1:]


def weights_digest(model: torch.nn.Module) -> str:
    """BLAKE3 of every tensor of the model's state, in key order: equal iff bit-identical."""
    h = blake3.blake3()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ciuic.demo.train", description=__doc__)
    p.add_argument("--store", default=None,
                   help="store location (default: $CIUIC_HOME or ./.ciuic)")
    p.add_argument("--project", default="demo",
                   help="the snapshots' project (default: %(default)s)")
    p.add_argument("--job", default="chargpt",
                   help="the job: run the same job again to resume it (default: %(default)s)")
    p.add_argument("--steps", type=int, default=300,
                   help="train until this step (default: %(default)s)")
    p.add_argument("--save-every", type=int, default=SAVE_EVERY,
                   help="a snapshot every this many steps (default: %(default)s)")
    p.add_argument("--keep-last", type=int, default=None,
                   help="keep this many snapshots (default: all)")
    p.add_argument("--kill-at", type=int, default=None,
                   help="SIGKILL this process after this step (a simulated crash)")
    p.add_argument("--no-snapshots", action="store_true", help="the uninterrupted reference run")
    p.add_argument("--result", type=Path, default=None, help="write a JSON summary here")
    p.add_argument("--seed", type=int, default=1337,
                   help="the data order's and the model's (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch's CPU threads (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)

    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    cfg = GPTConfig(vocab_size=len(chars))
    dataset = Windows(data, cfg.block_size)
    sampler = ResumableSampler(dataset, shuffle=True, seed=args.seed)
    # The loader gets its own generator, so creating an iterator does not draw from the global
    # RNG (a resumed run creates one at a point where the uninterrupted run did not).
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, generator=torch.Generator())
    model = CharGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

    manager = None
    start = 0
    restore_s = 0.0
    if not args.no_snapshots:
        manager = SnapshotManager(args.project, job=args.job, store=args.store,
                                  save_interval=args.save_every, keep_last=args.keep_last)
        t0 = time.perf_counter()
        last = manager.restore(model, optimizer, sampler=sampler, scheduler=scheduler)
        restore_s = time.perf_counter() - t0
        start = 0 if last is None else last + 1

    batches = iter(loader)
    loss_value = float("nan")
    t_train = time.perf_counter()
    step_s: list[float] = []  # each step's wall time, snapshot included (for the benchmark)
    for step in range(start, args.steps):
        t_step = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        _, loss = model(x, y)
        assert loss is not None
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        loss_value = loss.item()
        if manager is not None:
            manager.step(step, model, optimizer, sampler=sampler, scheduler=scheduler,
                         loss=loss_value)
        step_s.append(time.perf_counter() - t_step)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"  step {step:4d}  loss {loss_value:.4f}", flush=True)
        if step == args.kill_at:
            print(f"  step {step:4d}  -> SIGKILL (simulated crash)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    result = {
        "digest": weights_digest(model), "start": start, "steps": args.steps,
        "loss": loss_value, "restore_s": restore_s,
        "train_s": time.perf_counter() - t_train, "total_s": time.perf_counter() - t_start,
        "snapshots": manager.stats.snapshots if manager else 0,
        "bytes_total": manager.stats.bytes_total if manager else 0,
        "bytes_new": manager.stats.bytes_new if manager else 0,
        "restored_step": manager.restored.step if manager and manager.restored else None,
        "step_s": step_s,
    }
    if manager is not None:
        manager.close()
    sample_gen = torch.Generator().manual_seed(0)
    model.eval()
    out = model.generate(torch.tensor([[chars.index("T")]]), 80, sample_gen)
    result["sample"] = "".join(chars[i] for i in out[0].tolist())
    if args.result:
        args.result.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # a second Ctrl-C during the emergency snapshot: stop at once
        print("interrupted; run the same command again to resume from the latest snapshot",
              file=sys.stderr)
        sys.exit(130)
