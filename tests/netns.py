"""Simulated nodes for the many-node tests: each node a network namespace with its own address.

    def test_x(netns_nodes: Callable[[int], Nodes]) -> None:   # the fixture below
        nodes = netns_nodes(2)                   # bridge cbr<id>, netns ciuic-<id>-n1, -n2
        server = nodes[1].popen([sys.executable, "server.py"])   # runs inside node 1
        nodes[2].link(False)                     # node 2's switch port down (a cable pulled)
        nodes[2].kill_all()                      # SIGKILL every process of node 2, by pid

One bridge per set (MTU 65000, no host address, so the host neither routes nor answers, unless
``host=True`` gives it ``10.77.<X>.254``), and
per node a netns ``ciuic-<id>-n<i>`` holding the ``eth0`` end of a veth pair (MTU 65000) whose
other end ``cv<id>n<i>`` is a port of the bridge; ``eth0`` has ``10.77.<X>.<i>/24`` and ``lo``
is up. Traffic goes only between the nodes' addresses and each node's loopback. The netns share
the host's mount namespace (``ip netns exec`` only remounts /sys), so a host directory is a
shared store. Gloo picks its interface by the hostname, which resolves to no node address:
``node.env`` sets ``GLOO_SOCKET_IFNAME=eth0``.

``<id>`` is ``<creator pid>x<sequence>``: sets of one process, of parallel runs and of a crashed
earlier run never collide, and a set whose creator pid is gone is a leftover that the next set
removes. ``X`` only varies; two sets may share it (each bridge is its own segment).

As root only: a test skips with the reason where the ``ip`` tool is missing, the process is not
root, or ``ip netns add`` fails (no CAP_SYS_ADMIN, a read-only /run/netns, ...). Every set is
removed in ``finally`` (its processes SIGKILLed, the netns and the bridge deleted), also when
the test fails.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import pytest

from ciuic.chain.runs import pid_alive

PREFIX = "ciuic-"
MTU = 65000
_SEQ = itertools.count(1)
_NETNS = re.compile(rf"^{PREFIX}(\d+)x(\d+)-n(\d+)$")
_BRIDGE = re.compile(r"^cbr(\d+)x(\d+)$")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    run = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and run.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {run.stderr.strip()} (exit {run.returncode})")
    return run


def netns_pids(name: str) -> list[int]:
    """The processes whose network namespace is ``name`` (empty when it is gone)."""
    run = ip("netns", "pids", name, check=False)
    return [int(p) for p in run.stdout.split()] if run.returncode == 0 else []


def kill_netns_processes(name: str, rounds: int = 50) -> list[int]:
    """SIGKILL every process of the netns, by pid, until none is left (a dying parent may fork
    once more); returns the pids killed."""
    killed: list[int] = []
    for _ in range(rounds):
        pids = [p for p in netns_pids(name) if p != os.getpid()]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return killed


@dataclass
class Node:
    """One simulated node: ``netns`` with ``addr`` on its ``eth0``; ``port`` is the host end."""

    index: int
    netns: str
    addr: str
    port: str
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process of this node (gloo on the node's own interface)."""
        return {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``args`` inside the node (``ip netns exec``; the Popen's pid is the command's:
        ``ip`` execs it). ``env`` defaults to ``self.env``."""
        kwargs.setdefault("env", self.env)
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *args], **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, args: Sequence[str], timeout: float = 60,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        kwargs.setdefault("env", self.env)
        return subprocess.run(["ip", "netns", "exec", self.netns, *args], capture_output=True,
                              text=True, timeout=timeout, **kwargs)

    def pids(self) -> list[int]:
        return netns_pids(self.netns)

    def kill_all(self) -> list[int]:
        """SIGKILL every process of the node (a node lost, agent and all), then reap ours."""
        killed = kill_netns_processes(self.netns)
        for proc in self.procs:
            if proc.poll() is None:
                with suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        return killed

    def link(self, up: bool) -> None:
        """The node's switch port (the bridge end of its veth) up or down: down, the node loses
        carrier and its packets are dropped silently, as for a pulled cable or a dead switch
        port; its own address and routes stay."""
        ip("link", "set", self.port, "up" if up else "down")


class Nodes:
    """A set of simulated nodes on one bridge; ``nodes[i]`` is node i (1-based)."""

    def __init__(self, count: int) -> None:
        seq = next(_SEQ)
        self.id = f"{os.getpid()}x{seq}"
        self.subnet = (os.getpid() * 7 + seq) % 250 + 1
        self.bridge = f"cbr{self.id}"
        if len(f"cv{self.id}n{count}") > 15:  # IFNAMSIZ - 1
            raise ValueError(f"interface names too long for {count} nodes: {self.id}")
        self.nodes: list[Node] = []
        self.created: list[str] = []  # the netns made so far, for close()
        self.bridged = False

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i - 1]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def host_addr(self) -> str:
        """The host's address on the bridge, where :meth:`make` gave it one (``host=True``)."""
        return f"10.77.{self.subnet}.254"

    def make(self, count: int, host: bool = False) -> None:
        """The bridge and ``count`` nodes; ``host``: the host gets :attr:`host_addr` on the
        bridge (a daemon on the host that the nodes reach, Slurm's controller)."""
        ip("link", "add", self.bridge, "type", "bridge")
        self.bridged = True
        # Bridged frames must not go through the host's iptables FORWARD chain, which may drop
        # them (br_netfilter loaded, bridge-nf-call-iptables=1, a DROP policy): this bridge only.
        ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0",
           "nf_call_ip6tables", "0", "nf_call_arptables", "0")
        ip("link", "set", self.bridge, "mtu", str(MTU), "up")
        if host:
            ip("addr", "add", f"{self.host_addr}/24", "dev", self.bridge)
        for i in range(1, count + 1):
            name, port = f"{PREFIX}{self.id}-n{i}", f"cv{self.id}n{i}"
            ip("netns", "add", name)
            self.created.append(name)
            ip("link", "add", port, "mtu", str(MTU), "type", "veth", "peer", "name", "eth0",
               "mtu", str(MTU), "netns", name)
            ip("link", "set", port, "master", self.bridge, "up")
            addr = f"10.77.{self.subnet}.{i}"
            ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "link", "set", "lo", "up")
            self.nodes.append(Node(i, name, addr, port))

    def close(self) -> None:
        """Kill every node's processes, delete the veths, the netns and the bridge. Each step
        runs even if an earlier one failed; the errors are raised together at the end."""
        errors: list[str] = []
        for name in self.created:
            kill_netns_processes(name)
        for node in self.nodes:
            for proc in node.procs:
                if proc.poll() is None:
                    proc.kill()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    errors.append(f"pid {proc.pid} of {node.netns} did not exit")
        for node in self.nodes:  # now: the kernel frees a deleted netns's devices later
            ip("link", "del", node.port, check=False)
        for name in self.created:
            run = ip("netns", "del", name, check=False)
            if run.returncode != 0:
                errors.append(f"ip netns del {name}: {run.stderr.strip()}")
        if self.bridged:
            run = ip("link", "del", self.bridge, check=False)
            if run.returncode != 0:
                errors.append(f"ip link del {self.bridge}: {run.stderr.strip()}")
        if errors:
            raise RuntimeError("; ".join(errors))


def remove_leftovers() -> list[str]:
    """Delete the netns and bridges of sets whose creating process is gone (a crashed or killed
    earlier run); never those of a live process. Returns what was removed."""
    removed = []
    listed = ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ")[0]
        m = _NETNS.match(name)
        if m and not pid_alive(int(m.group(1))):
            kill_netns_processes(name)
            if ip("netns", "del", name, check=False).returncode == 0:
                removed.append(name)
    links = ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines()
    for line in links:
        bridge = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = _BRIDGE.match(bridge)
        if (m and not pid_alive(int(m.group(1)))
                and ip("link", "del", bridge, check=False).returncode == 0):
            removed.append(bridge)
    return removed


def unavailable() -> str | None:
    """Why simulated nodes cannot be made here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "simulated nodes need root (network namespaces, veth pairs and a bridge)"
    if shutil.which("ip") is None:
        return "simulated nodes need the `ip` tool (iproute2), which is not installed"
    return None


@contextmanager
def simulated_nodes(count: int, host: bool = False) -> Iterator[Nodes]:
    """``count`` nodes (``host``: the host on their bridge too), removed on exit; skips the
    test where they cannot be made."""
    why = unavailable()
    if why:
        pytest.skip(why)
    remove_leftovers()
    nodes = Nodes(count)
    try:
        try:
            nodes.make(count, host)
        except RuntimeError as e:
            if "netns add" in str(e) or not nodes.created:
                pytest.skip(f"cannot make network namespaces here: {e}")
            raise
        yield nodes
    finally:
        nodes.close()


@pytest.fixture
def netns_nodes() -> Iterator[Callable[[int], Nodes]]:
    """A factory: ``netns_nodes(n)`` makes n simulated nodes, removed after the test (last made,
    first removed)."""
    with ExitStack() as stack:
        yield lambda count: stack.enter_context(simulated_nodes(count))
