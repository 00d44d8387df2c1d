"""Run a torchrun job and leave nothing of it behind (tests/test_megatron.py,
bench/megatron_stall.py).

torchrun starts each rank in a session of its own, and megatron-core's checkpoint writers
(``multiprocessing`` spawn workers and their resource tracker) outlive a rank that is killed:
reparented to init, they keep the job's output pipes open, so waiting for the output would
wait forever, and killing torchrun's process group misses them. So every process of a run
carries a marker in its environment; the run's output goes to files; once torchrun exits (or
times out), every process with the marker is SIGKILLed, by its id.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

MARKER = "CIUIC_TEST_RUN"


def marked(marker: str) -> list[int]:
    """The processes whose environment carries ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
    return found


def run(command: Sequence[str], env: dict[str, str], timeout: float
        ) -> subprocess.CompletedProcess[str]:
    """``command`` to its end (or ``timeout``), then every process it started SIGKILLed."""
    marker = uuid.uuid4().hex
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(list(command), stdout=out, stderr=err, text=True,
                             env={**env, MARKER: marker}, start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            err.write(f"\n[timed out after {timeout} s]\n")
        finally:
            for pid in marked(marker):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            p.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(list(command), p.returncode, out.read(), err.read())
