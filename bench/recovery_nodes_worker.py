"""The training job of bench/recovery_nodes.py (see there): one DDP rank (gloo) of a 2-node x
2-rank torchrun job, under ``ciuic run`` on each node. The model's parameters have the shapes of
bench/run.py's reference state (a GPT-like model; with Adam's two moments about ``--gib`` GiB);
every step changes every parameter (a gradient on each, all-reduced, then Adam), so every
snapshot is a full one. It runs until the benchmark kills it.

Every start appends one JSON line to ``--times`` once its first ``step()`` has returned: the
rank, its pid, the step it restored (None on a new job) and the times (``time.time()``, one
clock for every netns) at which its interpreter started, its process group was up, its model,
DDP, optimizer and manager were built, ``restore()`` returned and its first ``step()`` (one
training step, then ``manager.step``) returned.
"""

import time

T_START = time.time()  # before the imports: a restart's interpreter start counts

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import gpt_shapes  # noqa: E402  (bench/run.py)

from ciuic import SnapshotManager  # noqa: E402


def shapes(gib: float) -> dict[str, tuple[int, ...]]:
    """bench/run.py's reference shapes (``gib`` 1.0: d=1024, 24k vocabulary, 5 layers: 88 M
    parameters, 0.99 GiB with Adam's moments), both dimensions scaled by sqrt(gib)."""
    s = math.sqrt(gib)
    d = max(64, round(1024 * s / 64) * 64)
    return gpt_shapes(d, max(64, round(24_000 * s)), 5,
                      {"pos_emb": (1024, d), "ln_f.weight": (d,), "ln_f.bias": (d,)})


class Reference(nn.Module):
    """The parameters only. The loss, ``x`` times the sum of every parameter's squared norm, is
    cheap to compute; its gradient (``2 x p``) differs from element to element, so Adam's
    moments do too (a constant gradient would make them constant tensors whose chunks are all
    one digest: a snapshot of a third of the bytes)."""

    def __init__(self, gib: float) -> None:
        super().__init__()
        for name, shape in shapes(gib).items():
            self.register_parameter(name.replace(".", "_"), nn.Parameter(torch.empty(shape)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.stack([torch.dot(p.view(-1), p.view(-1))
                                for p in self.parameters()]).sum()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True, type=Path)
    p.add_argument("--times", required=True, type=Path)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds of idle 'accelerator work' per step (leaves the CPU free)")
    a = p.parse_args()
    torch.set_num_threads(1)  # 4 ranks on the 2 cores
    dist.init_process_group("gloo")
    t_pg = time.time()
    rank = dist.get_rank()
    model = Reference(a.gib)
    if not (a.store / "catalog.db").exists():  # a new job: initialize (a restore overwrites)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for prm in model.parameters():
                prm.normal_(0.0, 0.02, generator=g)
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    manager = SnapshotManager("bench", store=a.store, save_interval=a.every,
                              compression="off", health=False)
    t_built = time.time()
    last = manager.restore(ddp, opt)
    t_restored = time.time()
    step = 0 if last is None else last + 1
    first = True
    while True:
        g = torch.Generator().manual_seed(step)
        ddp(torch.rand((), generator=g)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if a.step_sleep:
            time.sleep(a.step_sleep)
        manager.step(step, ddp, opt)
        if first:
            first = False
            row = {"rank": rank, "pid": os.getpid(), "restored": last, "start": T_START,
                   "pg": t_pg, "built": t_built, "restored_at": t_restored,
                   "first_step": time.time(),
                   "torchrun_restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   "ciuic_restart": int(os.environ.get("CIUIC_RUN_RESTART", "0"))}
            with open(a.times, "a") as f:  # one write of one line: appends do not interleave
                f.write(json.dumps(row) + "\n")
        step += 1


if __name__ == "__main__":
    main()
