"""Why a run stopped, in one line: an exit by a signal, the kernel's OOM killer (with its
evidence), a Python exception (its last line of stderr), a hang (from the heartbeats), or a
preemption (a signal to the supervisor).

Under torchrun the command's own exit says little (torchrun exits 1 whatever happened to a
worker), so its "Root Cause (first observed failure)" report is read from the stderr tail: the
failing rank and its exit code.
"""

from __future__ import annotations

import collections
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")
_ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning|"
                        r"Failure|Fault)|[A-Za-z_][\w.]*\.[A-Z]\w*)(?::\s.*)?$")


@dataclass(frozen=True)
class Cause:
    """What stopped a run: ``kind`` (signal, oom, exception, exit, hang, preempted) and the
    line the supervisor logs and passes on."""

    kind: str
    text: str

    def __str__(self) -> str:
        return self.text


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class OomWatch:
    """The kernel's OOM-kill counters where this machine lets us read them, taken at a start
    and compared after an exit: the job's cgroup (v2 ``memory.events``, v1
    ``memory.oom_control``) and the machine's (``/proc/vmstat``)."""

    def __init__(self) -> None:
        self.sources = _oom_sources()
        self.before = {name: _read_counter(path) for name, path in self.sources.items()}

    def evidence(self) -> str | None:
        """A description of the OOM kills since the start, or None when none was counted."""
        for name, path in self.sources.items():
            was, now = self.before.get(name), _read_counter(path)
            if was is not None and now is not None and now > was:
                return f"{name} oom_kill {was} -> {now}"
        return None


def _oom_sources() -> dict[str, Path]:
    found: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":  # v2
            path = Path("/sys/fs/cgroup") / rel.lstrip("/") / "memory.events"
            if path.exists():
                found[f"cgroup {path}"] = path
        elif "memory" in controllers.split(","):
            for root in (Path("/sys/fs/cgroup/memory") / rel.lstrip("/"),
                         Path("/sys/fs/cgroup/memory")):
                if (root / "memory.oom_control").exists():
                    found[f"cgroup {root / 'memory.oom_control'}"] = root / "memory.oom_control"
                    break
    found["/proc/vmstat"] = Path("/proc/vmstat")
    return found


def _read_counter(path: Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def exception_line(tail: list[str]) -> str | None:
    """The exception a traceback in ``tail`` ended with (the last one that is not torchrun's
    own ``ChildFailedError`` about a worker), else the last non-empty line."""
    lines = [_RANK_PREFIX.sub("", x.rstrip()) for x in tail]
    found = None
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last)"):
            continue
        for after in lines[i + 1:]:
            if after and not after[0].isspace() and _EXCEPTION.match(after):
                if "ChildFailedError" not in after:
                    found = after
                break
    if found is None:
        found = next((x for x in reversed(lines) if x.strip() and not set(x) <= {"=", "-"}),
                     None)
    return found[:300] if found else None


def classify(returncode: int, tail: list[str], oom: OomWatch | None) -> Cause:
    """The cause of a run that exited with ``returncode`` (negative: killed by that signal),
    given the last lines of its stderr."""
    text = "\n".join(tail)
    rank = ""
    if "ChildFailedError" in text or "Root Cause (first observed failure)" in text:
        m = _ROOT_CAUSE.search(text.split("Root Cause (first observed failure)")[-1])
        if m:  # torchrun: the failing worker's own exit
            rank = f"rank {m.group(1)}: "
            code = int(m.group(2))
            returncode = code if code < 0 else (returncode if code == 0 else code)
    signum = -returncode if returncode < 0 else (returncode - 128 if 128 < returncode < 160
                                                 and returncode != 255 else 0)
    evidence = oom.evidence() if oom is not None else None
    if signum == signal.SIGKILL and evidence:
        return Cause("oom", f"oom: {rank}killed by the kernel's OOM killer ({evidence})")
    if signum:
        how = "exit " + str(returncode) if returncode > 0 else "killed"
        extra = "; the kernel's OOM killer may have done it" if (
            signum == signal.SIGKILL and oom is not None and not oom.sources) else ""
        return Cause("signal", f"signal: {rank}{signal_name(signum)} ({how}){extra}")
    line = exception_line(tail)
    if line and _EXCEPTION.match(line):
        return Cause("exception", f"exception: {rank}{line}")
    return Cause("exit", f"{rank}exit status {returncode}"
                 + (f", last stderr line: {line}" if line else ""))


#: signals a process raises on itself: a consequence as often as a cause (see
#: ``agent.Supervisor._worker_cause``)
RAISED = frozenset({signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE,
                     signal.SIGILL})
#: torchrun's line for a worker that failed (its agent then restarts the worker group)
WORKER_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
#: a line of a worker's uncaught exception (torch prefixes each with ``[rankR]: `` in a process
#: group; torchrun's ``--tee`` may add its own prefix before) saying that its connection to
#: another rank was lost: gloo's transport's words (with its source file: not any library's
#: "Connection reset by peer", as a data loader's HTTP error says) and NCCL's, when a peer
#: process died. That worker's failure is a consequence of another's.
PEER_LOST = re.compile(r"\[rank(\d+)\]:\s?.*(?:gloo/transport/\S+\].*(?:Connection (?:closed|"
                        r"reset) by peer|Broken pipe)|ncclRemoteError|remote process exited)")


def forward(proc: subprocess.Popen[bytes], tail: collections.deque[str],
             failed: collections.deque[str]) -> None:
    """Pass the command's stderr through, keeping its last lines, and torchrun's lines for
    failed workers and the workers' lines for a lost peer in ``failed``."""
    assert proc.stderr is not None
    out = sys.stderr.buffer
    for line in iter(proc.stderr.readline, b""):
        try:
            out.write(line)
            out.flush()
        except (OSError, ValueError):
            pass
        text = line.decode(errors="replace").rstrip("\n")
        tail.append(text)
        if WORKER_FAILED.search(text) or PEER_LOST.search(text):
            failed.append(text)
