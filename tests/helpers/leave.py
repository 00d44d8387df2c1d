"""How a test job run under torchrun ends: without the interpreter's teardown.

At exit, torch's gloo/c10d objects sometimes abort a finished rank ("terminate called without an
active exception", SIGABRT): seen in 6 of 12 runs of a burst of tests/helpers/dist_train.py with
no ciuic manager at all, with FSDP2 under tests/helpers/sup_train.py, and once in CI after
tests/helpers/tt_train.py had printed its result, and once in a slow-suite run of
tests/helpers/acc_train.py in Accelerate's own mode (no ciuic). torchrun takes the abort for a
failure of the finished job. Every script calls this only after its output is written and its
process groups are destroyed.
"""

from __future__ import annotations

import os
import sys


def leave(code: int | None) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
