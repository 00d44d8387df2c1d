"""Two ranks, one state saved by rank 0 alone (as a framework hands rank 0 its checkpoint dict),
then restored on every rank by a second manager (run under torchrun; gloo, CPU).

    python -m torch.distributed.run --nproc-per-node 2 tests/helpers/dist_shared.py STORE OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from leave import leave  # beside this script
from torch import nn

from ciuic import SnapshotManager


def main() -> int:
    store, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with SnapshotManager("p", job="shared", store=store, handle_signals=False) as m:
        shared = {"framework": {"epoch": 3, "loops": [1, 2]}} if rank == 0 else {}
        m.save(1, model, optimizer, mine={"rank": rank}, **shared)
    with SnapshotManager("p", job="shared", store=store, handle_signals=False) as m:
        last = m.restore(model, optimizer)
        (out / f"rank{rank}.json").write_text(json.dumps(
            {"step": last, "values": m.restored_values}, sort_keys=True))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())  # not sys.exit: see tests/helpers/leave.py
