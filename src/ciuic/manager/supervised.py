"""A manager under ``ciuic run``: its heartbeats, its host-memory tier, and what the supervisor
said about the previous start (:mod:`ciuic.supervisor`).

Outside ``ciuic run`` (no ``CIUIC_SUPERVISOR``) :func:`attach` returns None and nothing here
runs. A supervisor that cannot be reached is logged, and training goes on without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ciuic.distributed.collective import Collective
from ciuic.supervisor.beat import Beacon
from ciuic.supervisor.channel import CAUSE_ENV, PIDS_ENV, RESTART_ENV, STOPPED_AT_ENV, Link
from ciuic.supervisor.fetched import NodeReads
from ciuic.supervisor.hostcopy import HostTier
from ciuic.supervisor.peers import Node

log = logging.getLogger("ciuic")


@dataclass(frozen=True)
class Restart:
    """What ``ciuic run`` says about the start before this one."""

    number: int
    cause: str | None
    stopped_at: int | None
    pids: frozenset[int]

    @staticmethod
    def from_reply(reply: dict[str, Any]) -> Restart | None:
        """What ``ciuic run`` says in its attach reply about the generation before this one,
        when torchrun restarted the workers within one start (None: it says nothing)."""
        said = reply.get("restart")
        if not isinstance(said, dict):
            return None
        try:
            stopped = said.get("stopped_at")
            return Restart(int(said["number"]), str(said.get("cause") or "") or None,
                           None if stopped is None else int(stopped),
                           frozenset(int(p) for p in said.get("pids", [])))
        except (KeyError, TypeError, ValueError):
            return None

    def to_json(self) -> dict[str, Any]:
        return {"number": self.number, "cause": self.cause, "stopped_at": self.stopped_at,
                "pids": sorted(self.pids)}

    @staticmethod
    def from_json(said: Any) -> Restart | None:
        """What :meth:`to_json` gave (None: nothing, or not that)."""
        return Restart.from_reply({"restart": said})

    @staticmethod
    def from_env() -> Restart | None:
        env = os.environ
        try:
            number = int(env.get(RESTART_ENV, "0") or 0)
        except ValueError:
            return None
        if number <= 0:
            return None
        stopped = env.get(STOPPED_AT_ENV)
        pids = frozenset(int(p) for p in env.get(PIDS_ENV, "").split(",") if p.isdigit())
        return Restart(number, env.get(CAUSE_ENV) or None,
                       int(stopped) if stopped and stopped.lstrip("-").isdigit() else None, pids)


#: how long a run started before its ``ciuic run`` knew why the previous generation stopped
#: asks it (its wait for another node's word, agent.CAUSE_WAIT_S, and a margin), and how often
CAUSE_ASK_S = 45.0
CAUSE_ASK_EVERY_S = 1.0
#: how long a run that ends while still asking (a short job, or a job's last steps soon after
#: a restart) waits at its close for the cause, asking every :data:`CAUSE_ASK_CLOSING_EVERY_S`
CAUSE_AT_CLOSE_S = 3.0
CAUSE_ASK_CLOSING_EVERY_S = 0.2
#: how the previous run ended, while ``ciuic run`` has not named the cause yet
NOT_KNOWN_YET = ("the cause is not known yet: ciuic run names it when another node's word "
                 "arrives, and this run records it then")


@dataclass
class PendingCause:
    """A restart whose cause ``ciuic run`` did not know when this run started (the workers
    of this node only lost their connection to another rank, whose node had not said why
    yet): rank 0 asks again on its ``step()`` calls, and records the cause once named, so that
    every message names the first cause, never a consequence."""

    run_id: str  # the previous run's
    number: int  # the restart's
    since: float
    next_ask: float = 0.0

    def ask(self, sup: Supervised, now: float) -> str | None:
        """The cause once ``ciuic run`` names it; "" once :data:`CAUSE_ASK_S` passed without
        one; None: ask again later."""
        if now < self.next_ask:
            return None
        self.next_ask = now + CAUSE_ASK_EVERY_S
        said = sup.restart_now()
        if said is not None and said.number == self.number and said.cause:
            return said.cause
        return "" if now - self.since >= CAUSE_ASK_S else None


@dataclass(frozen=True)
class Peers:
    """The job's nodes (their chunk services), this one's group rank, and this start's
    token; ``supervisor``, ``rank`` and ``secret``: this rank's channel to its node's
    ``ciuic run``, which reads the other nodes' memory for it."""

    nodes: list[Node]
    me: int
    token: str
    supervisor: str
    rank: int
    secret: str = field(repr=False)

    def reader(self) -> NodeReads:
        """Reads of the chunks this node lacks, through this node's ``ciuic run``: it fetches
        each from the node that holds it once for all of this node's ranks."""
        return NodeReads(self.supervisor, self.rank, self.secret)


class Supervised:
    """This process's link to its supervisor."""

    def __init__(self, link: Link, beacon: Beacon, tier: HostTier | None,
                 restart: Restart | None = None) -> None:
        self.link = link
        self.beacon = beacon
        self.tier = tier
        self.restart = restart or Restart.from_env()
        #: on a job of several nodes: the other nodes' memory (None: one node, or no tier)
        self.peers: Peers | None = None

    def restart_now(self) -> Restart | None:
        """What ``ciuic run`` says now about this start's restart (its cause may have come
        after this process attached); None where it says nothing or cannot be asked."""
        try:
            reply, _ = self.link.request({"op": "restart"})
        except (OSError, ValueError, ConnectionError) as e:
            log.debug("could not ask the supervisor about the restart: %s", e)
            return None
        return Restart.from_reply(reply) if reply.get("ok") else None

    def close(self) -> None:
        self.beacon.detach()
        self.link.close()


def attach() -> Supervised | None:
    """Attach to the supervisor in ``CIUIC_SUPERVISOR``, if any: its heartbeats and its
    host-memory tier (every rank of a torchrun job stages into shared memory, and restores from
    the chunks the node's ranks hold)."""
    link = Link.from_env()
    if link is None:
        return None
    try:
        region, reply = link.attach()
    except (OSError, ValueError, ConnectionError) as e:
        log.warning("the supervisor (ciuic run) did not answer (%s): no heartbeats and no "
                    "host-memory copy for this process", e)
        link.close()
        return None
    slot = int(os.environ.get("LOCAL_RANK", "0") or 0)
    beacon = Beacon(region, slot, link.rank, os.getpid())
    return Supervised(link, beacon, HostTier(link, reply), Restart.from_reply(reply))


@contextlib.contextmanager
def busy(sup: Supervised | None, kind: str) -> Iterator[None]:
    """Mark this rank busy (not hung) for the supervisor, when there is one."""
    if sup is None:
        yield
        return
    with sup.beacon.busy(kind):
        yield


def join_peers(sup: Supervised | None, coll: Collective, name_key: bytes | None) -> None:
    """On a job of several nodes (every rank calls it, at the same point, under ``ciuic run``
    or not): learn where every node's ``ciuic run`` serves chunks, and tell this node's the
    job's nodes and this start's token, so that nodes replicate to each other and a restore
    reads the chunks other nodes hold (``sup.peers``)."""
    mine: list[Any] | None = None
    if sup is not None and sup.tier is not None and sup.tier.enabled:
        try:
            reply, _ = sup.link.request({"op": "listen"})
            if reply.get("ok"):
                mine = [int(os.environ.get("GROUP_RANK", "0") or 0),
                        _address_towards(os.environ.get("MASTER_ADDR", "")),
                        int(reply["port"])]
        except (OSError, ValueError, ConnectionError) as e:
            log.warning("the supervisor could not serve this node's memory to the other "
                        "nodes (%s): their restores read the store", e)
    token = secrets.token_hex(16) if coll.coordinator else None
    everyone = coll.all_gather([mine, token])
    token = str(everyone[0][1])
    nodes = sorted({Node(int(m[0]), str(m[1]), int(m[2])) for m, _ in everyone if m},
                   key=lambda n: n.rank)
    if sup is not None and mine is not None and len(nodes) > 1:
        me = int(mine[0])
        try:
            sup.link.request({"op": "peers", "token": token, "me": me,
                              "nodes": [[n.rank, n.host, n.port] for n in nodes],
                              "keys": [name_key.hex()] if name_key else []})
            sup.peers = Peers(nodes, me, token, sup.link.name, sup.link.rank, sup.link.secret)
        except (OSError, ValueError, ConnectionError) as e:
            log.warning("the supervisor did not take the job's nodes (%s)", e)
    coll.all_gather(None)  # every node knows this start's token before anyone reads


def multi_node() -> bool:
    """Whether this process is a rank of a torchrun job of several nodes."""
    try:
        return int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1) > 1
    except ValueError:
        return False


def _address_towards(host: str) -> str:
    """This node's address on the route to ``host`` (the rendezvous host), which the other
    nodes reach it at; the host name's address where there is no such route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host or "127.0.0.1", 9))  # UDP: nothing is sent
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
