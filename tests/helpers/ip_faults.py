"""A fault at a step's end for the frameworks' jobs under in-process recovery
(tests/helpers/ip_hf_train.py, ip_pl_train.py): ``--fault STEP:RANK:ACTION``."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path


class StepEnd:
    """Logs each step's end to OUT/steps-RANK.jsonl (``{"step", "time", "gen"}``) and, at the
    end of global step STEP on rank RANK, strikes once (a marker file in OUT): SIGKILL
    (``kill``) or a ValueError (``raise``)."""

    def __init__(self, out: Path, fault: str | None) -> None:
        self.out = out
        self.rank = int(os.environ.get("RANK", "0"))
        self.gen = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.fault: tuple[int, str] | None = None
        if fault:
            step, rank, action = fault.split(":")
            if action not in ("kill", "raise"):
                raise SystemExit(f"--fault {fault}: ACTION is kill or raise")
            if int(rank) == self.rank:
                self.fault = (int(step), action)

    def __call__(self, step: int) -> None:
        with (self.out / f"steps-{self.rank}.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "time": time.time(), "gen": self.gen}) + "\n")
        if self.fault is None or self.fault[0] != step:
            return
        marker = self.out / f"fault-{step}-{self.rank}.json"
        if marker.exists():
            return
        marker.write_text(json.dumps({"time": time.time(), "action": self.fault[1]}))
        print(f"injected {self.fault[1]} at step {step} (rank {self.rank})", file=sys.stderr,
              flush=True)
        if self.fault[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError(f"injected failure at step {step} (rank {self.rank})")
