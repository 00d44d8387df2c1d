"""DLRover's flash checkpoint in bench/recovery.py's scenario, run by ``dlrover-run
--standalone`` (its own agent holds the shared memory): the first start saves the state to
memory (``StorageType.MEMORY``) at step 4, notes the time at step 5 and SIGKILLs itself; the
restart (TORCHELASTIC_RESTART_COUNT=1) loads the checkpoint, makes a step, writes its times."""

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import reference_state  # noqa: E402


def main() -> None:
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--times", required=True, type=Path)
    p.add_argument("--scale", type=int, default=1)
    a = p.parse_args()
    dist.init_process_group("gloo")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    state = reference_state(a.scale)
    names = sorted(state)
    ckpt = DdpCheckpointer(str(a.dir))
    if restart == 0:
        for step in range(1000):
            state[names[step % len(names)]].add_(1e-3)
            if step % 4 == 0:
                ckpt.save_checkpoint(step, {"state": state, "step": step},
                                     storage_type=StorageType.MEMORY)
            if step == 5:
                a.times.write_text(json.dumps({"fault": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
        return
    t_manager = time.time()
    loaded = ckpt.load_checkpoint()
    for k, v in loaded["state"].items():
        state[k].copy_(v)
    t_restored = time.time()
    state[names[0]].add_(1e-3)  # the first resumed step
    t_first = time.time()
    times = json.loads(a.times.read_text())
    times.update(start=T_START, manager=t_manager, restored=t_restored, first_step=t_first,
                 step=loaded["step"])
    a.times.write_text(json.dumps(times))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
