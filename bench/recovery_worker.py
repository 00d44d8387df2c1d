"""The training job of bench/recovery.py (see there). Its first start trains until a snapshot
is committed, evicts the store's files from the page cache, notes the time and SIGKILLs itself
(or hangs); its restart restores, makes one step() and writes its times."""

import time

T_START = time.time()  # before the imports: the restart's interpreter start counts

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import evict  # noqa: E402
from run import reference_state  # noqa: E402

from ciuic import SnapshotManager  # noqa: E402


class Holder:
    """The state as a module holds it: ``load_state_dict`` copies into the live tensors."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            self.state[k].copy_(v)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True, type=Path)
    p.add_argument("--times", required=True, type=Path)
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--fault", choices=("kill", "hang"), default="kill")
    a = p.parse_args()
    restart = int(os.environ.get("CIUIC_RUN_RESTART", "0"))
    state = reference_state(a.scale)
    holder = Holder(state)
    names = sorted(state)
    manager = SnapshotManager("bench", store=a.store, save_interval=4, compression="off",
                              health=False)
    if restart == 0:
        for step in range(1000):
            state[names[step % len(names)]].add_(1e-3)  # "training": one tensor changes
            manager.step(step, holder)
            if step == 5:  # the snapshot at step 4 is committed by now: fault here
                manager.wait()
                evict(a.store)
                a.times.write_text(json.dumps({"fault": time.time()}))
                if a.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
        return
    t_manager = time.time()
    last = manager.restore(holder)
    t_restored = time.time()
    assert last is not None
    manager.step(last + 1, holder)
    t_first = time.time()
    times = json.loads(a.times.read_text())
    times.update(start=T_START, manager=t_manager, restored=t_restored, first_step=t_first)
    a.times.write_text(json.dumps(times))
    manager.close(final=False)


if __name__ == "__main__":
    main()
