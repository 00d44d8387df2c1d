"""ciuic's background threads run at a lower CPU priority than the training thread.

While a snapshot is written, its threads (the writer, the chunk hashers and writers, the store's
calls, the batched fsync, buffer allocation, uploads to a mirror) compete with training for the
cores. On a machine whose cores are busy, the kernel shares them by weight; at the same priority
a training step that overlaps the writer slowed by 53 ms per snapshot of the demo model on the
2-core development VM (median of 35 snapshots), and with the background threads at nice +10 by
31 ms (docs/benchmarks.md, session 5). Where cores are idle (a GPU job's host) nothing changes.

Linux only: there a thread is a task with its own nice value. Elsewhere ``setpriority`` would
renice the whole process, so it is not called.
"""

from __future__ import annotations

import os
import sys
import threading

from .. import knobs


def lower_priority() -> None:
    """Make the calling thread :attr:`~ciuic.knobs.Knobs.background_nice` nicer than the
    process's main thread (at most 19); a thread already that nice or nicer is left as it is.
    Meant as a ``ThreadPoolExecutor`` initializer or the first call of a thread's target."""
    step = knobs.get().background_nice
    if step <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + step)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
    except OSError:  # not permitted here (a sandbox): keep the priority
        pass
