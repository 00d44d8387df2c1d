"""ciuic's own threads and copy pools in a forked child (a child has none of its parent's
threads)."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from ciuic.engine import unchanged
from ciuic.engine.own_thread import OwnThread


def test_own_threads_and_copy_pools_work_in_a_forked_child() -> None:
    """A forked child has none of its parent's threads: a pool that believed it had an idle
    worker waited forever (the compression decider hung a child's first snapshot)."""
    own = OwnThread("ciuic-test-fork")
    assert own.run(lambda: 1) == 1
    a = np.ones(4 * 1024 * 1024, dtype=np.uint8)  # NumPy: torch's OpenMP hangs after a fork
    b = np.zeros_like(a)
    unchanged.copy_changed(a.ctypes.data, b.ctypes.data, a.size, 1 << 20, None)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if both work
        signal.alarm(20)
        c = np.zeros_like(a)
        unchanged.copy_changed(a.ctypes.data, c.ctypes.data, a.size, 1 << 20, None)
        os._exit(0 if own.run(lambda: 2) == 2 and bool(c.all()) else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung")
