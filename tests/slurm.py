"""A real Slurm cluster on the simulated nodes, for the tests: slurmctld on the host, one slurmd
per node (tests/netns.py), a partition of them; from Debian's ``slurm-wlm`` and ``munge``
(installed by scripts/services.sh).

    with slurm_cluster(3) as cluster:           # nodes c1..c3, partition "ciuic"
        job = cluster.sbatch(script, tmp)       # the job's id; its output in tmp/slurm-<id>.out
        cluster.wait(job, "COMPLETED")
        cluster.lose(2)                         # node c2 lost: its slurmd and the job's processes

Each node is a network namespace with its own address (tests/netns.py), and a host name of its
own (slurmd runs in a UTS and a mount namespace: ``hostname`` says ``c1``, and ``/etc/hosts``
names every node), as on a real cluster: torchrun, gloo and ``scontrol show hostnames`` need
nothing set by hand. The controller is on the host, at the bridge's host address. One
``munged`` of the cluster's own (its own key and socket, ``AuthInfo=socket=``), so the host's
munge, if any, is left alone. Every path (state, spool, logs, PID files) is under one temporary
directory, ``SLURM_CONF`` points every command at its ``slurm.conf``; everything is stopped and
removed on exit, the node set with it.

Plugins for a machine without cgroups or systemd: ``proctrack/linuxproc`` (a job's processes
are found by parentage), ``task/none``, no accounting. Each node declares this machine's CPUs
(the nodes share them). A node that stops answering is DOWN after ``SlurmdTimeout`` (6 s here),
and a job on it is requeued where it allows it (``--requeue``); a requeued job waits
``cred_expire`` (10 s here, Slurm's default 120 s) before it starts again.

As root only, like the simulated nodes: skipped with the reason where they or Slurm cannot
start.

    python -m tests.slurm      # start one of 3 nodes, print how to use it, wait for Ctrl-C
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import netns
from tests.cluster import die_with_parent, stop_daemons
from tests.s3server import free_port

BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "munged")
PARTITION = "ciuic"
#: a node that misses pings this long is DOWN, and its jobs requeued or failed
SLURMD_TIMEOUT_S = 6


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


@dataclass
class SlurmCluster:
    base: Path
    nodes: netns.Nodes
    names: list[str]  # the Slurm node names, node i is names[i - 1]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """The environment of a Slurm command (sbatch, squeue ...) for this cluster; a job
        inherits it (sbatch's default ``--export=ALL``): this Python's scripts first on its
        PATH (``ciuic``, ``torchrun``)."""
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        return {**os.environ, "SLURM_CONF": str(self.base / "slurm.conf"), "PATH": path}

    def command(self, *args: str, timeout: float = 30, check: bool = True
                ) -> subprocess.CompletedProcess[str]:
        run = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                             env=self.env)
        if check and run.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: {run.stderr.strip()} (exit {run.returncode})")
        return run

    # -- the daemons -------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        log = (self.base / f"{name}.out").open("ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                start_new_session=True, preexec_fn=die_with_parent)
        self.procs[name] = proc
        return proc

    def start_slurmd(self, i: int) -> None:
        """Node i's slurmd, in its netns, with a mount and a UTS namespace of its own: the host
        name is the node's, ``/etc/hosts`` the node set's (started again after :meth:`lose`: a
        node back with empty memory).

        ``nsenter --net``, not ``ip netns exec``, which mounts a /sys of the netns without the
        cgroup tree that slurmd's start reads (its cgroup plugin loads even under
        proctrack/linuxproc)."""
        name, node = self.names[i - 1], self.nodes[i]
        (self.base / "spool" / name).mkdir(exist_ok=True)
        hosts = self.base / "hosts"
        node.procs.append(self._spawn(f"slurmd-{name}", [
            "nsenter", f"--net=/run/netns/{node.netns}", "unshare", "--mount", "--uts", "sh",
            "-c", f"mount --bind {hosts} /etc/hosts && hostname {name} && "
                  f"exec slurmd -D -N {name}"]))

    def lose(self, i: int) -> list[int]:
        """Node i lost: its slurmd, every process of the job on it, all SIGKILLed."""
        return self.nodes[i].kill_all()

    def state(self, i: int) -> str:
        """Node i's state as sinfo says it (``idle``, ``alloc``, ``down*`` ...)."""
        return self.command("sinfo", "-h", "-n", self.names[i - 1], "-o", "%t").stdout.strip()

    def wait_nodes(self, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while True:
            states = [self.state(i) for i in range(1, len(self.names) + 1)]
            if all(s == "idle" for s in states):
                return
            if time.monotonic() > end:
                raise RuntimeError(f"the Slurm nodes are not idle after {timeout:g} s: "
                                   f"{states}\n{self.logs()}")
            time.sleep(0.3)

    # -- jobs --------------------------------------------------------------------------------

    def sbatch(self, script: str, workdir: Path, *args: str,
               env: dict[str, str] | None = None) -> int:
        """Submit ``script`` from ``workdir`` (its output goes to ``workdir/slurm-<id>.out``,
        Slurm's default); returns the job's id."""
        path = workdir / "job.sbatch"
        path.write_text(script)
        run = subprocess.run(["sbatch", "--parsable", "-p", PARTITION, *args, str(path)],
                             capture_output=True, text=True, timeout=30, cwd=workdir,
                             env={**self.env, **(env or {})})
        if run.returncode != 0:
            raise RuntimeError(f"sbatch: {run.stderr.strip()}")
        return int(run.stdout.strip().split(";")[0])

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job``'s fields (``JobState``, ``Restarts``, ``NodeList`` ...)."""
        text = self.command("scontrol", "show", "job", str(job), "-o").stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job: int, *states: str, timeout: float = 300) -> dict[str, str]:
        """Wait until the job is in one of ``states`` (``RUNNING``, ``COMPLETED``, ...);
        returns its fields. A job that ends in another state raises with its output."""
        end = time.monotonic() + timeout
        done = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
        while True:
            fields = self.job(job)
            state = fields.get("JobState", "")
            if state in states:
                return fields
            if state in done or time.monotonic() > end:
                raise AssertionError(f"job {job} is {state}, not {'/'.join(states)}: {fields}\n"
                                     f"{self.logs()}")
            time.sleep(0.3)

    def logs(self, tail: int = 1500) -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-tail:]}"
                       for p in sorted(self.base.glob("*.log")))

    def close(self) -> None:
        stop_daemons(self.procs)
        shutil.rmtree(self.base, ignore_errors=True)


def _conf(base: Path, names: list[str], nodes: netns.Nodes, ports: tuple[int, int]) -> str:
    cpus = os.cpu_count() or 1
    lines = {
        "ClusterName": "ciuic",
        "SlurmctldHost": f"{socket.gethostname().split('.')[0]}({nodes.host_addr})",
        "SlurmctldPort": str(ports[0]),
        "SlurmdPort": str(ports[1]),
        "AuthType": "auth/munge",
        "AuthInfo": f"socket={base / 'munge' / 'munge.socket'},cred_expire=10",
        "CredType": "cred/munge",
        "SlurmUser": "root",
        "SlurmdUser": "root",
        "StateSaveLocation": str(base / "state"),
        "SlurmdSpoolDir": str(base / "spool" / "%n"),
        "SlurmctldPidFile": str(base / "slurmctld.pid"),
        "SlurmdPidFile": str(base / "slurmd-%n.pid"),
        "SlurmctldLogFile": str(base / "slurmctld.log"),
        "SlurmdLogFile": str(base / "slurmd-%n.log"),
        "ProctrackType": "proctrack/linuxproc",
        "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres",
        "SelectTypeParameters": "CR_CPU",
        "JobAcctGatherType": "jobacct_gather/none",
        "AccountingStorageType": "accounting_storage/none",
        "MpiDefault": "none",
        "SlurmdParameters": "config_overrides",
        "ReturnToService": "2",  # a node whose slurmd answers again is idle again
        "SlurmdTimeout": str(SLURMD_TIMEOUT_S),
        "SlurmctldTimeout": "10",
        "MessageTimeout": "5",
        "KillWait": "10",
        "MinJobAge": "600",
        "JobRequeue": "0",  # only jobs that ask for it (--requeue)
        "SlurmctldDebug": "info",
        "SlurmdDebug": "info",
    }
    text = "".join(f"{k}={v}\n" for k, v in lines.items())
    for i, name in enumerate(names, 1):
        text += f"NodeName={name} NodeAddr={nodes[i].addr} CPUs={cpus} State=UNKNOWN\n"
    text += (f"PartitionName={PARTITION} Nodes={','.join(names)} Default=YES MaxTime=INFINITE "
             "State=UP OverSubscribe=FORCE:4\n")
    return text


def _hosts(names: list[str], nodes: netns.Nodes) -> str:
    own = "".join(f"{node.addr} {name}\n" for name, node in zip(names, nodes, strict=True))
    return f"127.0.0.1 localhost\n{nodes.host_addr} slurm-controller\n{own}"


@contextlib.contextmanager
def slurm_cluster(count: int) -> Iterator[SlurmCluster]:
    """A cluster of ``count`` nodes (``c1`` ...), stopped and removed on exit; skips the test
    where it cannot start (not root, Slurm or munge missing)."""
    lacking = missing_binaries()
    if lacking:
        pytest.skip(f"Slurm is not installed ({', '.join(lacking)} missing): run "
                    "scripts/services.sh as root, or install Debian's slurm-wlm and munge")
    with netns.simulated_nodes(count, host=True) as nodes:
        base = Path(tempfile.mkdtemp(prefix="ciuic-slurm-"))
        cluster = SlurmCluster(base, nodes, [f"c{i}" for i in range(1, count + 1)])
        try:
            _start(cluster, count)
            yield cluster
        finally:
            cluster.close()


def _start(cluster: SlurmCluster, count: int) -> None:
    base = cluster.base
    for d in ("state", "spool", "munge"):
        (base / d).mkdir(mode=0o700)
    base.chmod(0o755)  # munged: the socket's directories searchable by all
    (base / "munge").chmod(0o755)
    key = base / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge = base / "munge"
    (base / "hosts").write_text(_hosts(cluster.names, cluster.nodes))
    cluster._spawn("munged", ["munged", "-F", f"--key-file={key}",
                              f"--socket={munge / 'munge.socket'}",
                              f"--pid-file={munge / 'munged.pid'}",
                              f"--seed-file={munge / 'munged.seed'}",
                              f"--log-file={base / 'munged.log'}"])
    _wait_for(lambda: (munge / "munge.socket").exists(), 10, "munged's socket", cluster)
    (base / "slurm.conf").write_text(_conf(base, cluster.names, cluster.nodes,
                                           (free_port(), free_port())))
    cluster._spawn("slurmctld", ["slurmctld", "-D", "-i"])
    _wait_for(lambda: cluster.command("scontrol", "ping", check=False).returncode == 0
              and "UP" in cluster.command("scontrol", "ping", check=False).stdout, 30,
              "slurmctld", cluster)
    for i in range(1, count + 1):
        cluster.start_slurmd(i)
    cluster.wait_nodes()


def _wait_for(what: Any, timeout: float, name: str, cluster: SlurmCluster) -> None:
    end = time.monotonic() + timeout
    while not what():
        for proc_name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{proc_name} exited ({proc.returncode}) before {name} was "
                                   f"ready:{cluster.logs()}"
                                   + (cluster.base / f"{proc_name}.out").read_text()[-1500:])
        if time.monotonic() > end:
            raise RuntimeError(f"{name} not ready after {timeout:g} s:{cluster.logs()}")
        time.sleep(0.2)


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` stops it cleanly
    with slurm_cluster(3) as c:
        print(f"Slurm: nodes {', '.join(c.names)} (partition {PARTITION}); "
              f"export SLURM_CONF={c.base / 'slurm.conf'}; logs in {c.base}")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
