"""A manager under ``ciuic run``: its heartbeats, its host-memory tier, and what the supervisor
said about the previous start (:mod:`ciuic.supervisor`).

Outside ``ciuic run`` (no ``CIUIC_SUPERVISOR``) :func:`attach` returns None and nothing here
runs. A supervisor that cannot be reached is logged, and training goes on without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from ciuic.supervisor.beat import Beacon
from ciuic.supervisor.channel import CAUSE_ENV, PIDS_ENV, RESTART_ENV, STOPPED_AT_ENV, Link
from ciuic.supervisor.hostcopy import HostTier

log = logging.getLogger("ciuic")


@dataclass(frozen=True)
class Restart:
    """What ``ciuic run`` says about the start before this one."""

    number: int
    cause: str | None
    stopped_at: int | None
    pids: frozenset[int]

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


class Supervised:
    """This process's link to its supervisor."""

    def __init__(self, link: Link, beacon: Beacon, tier: HostTier | None) -> None:
        self.link = link
        self.beacon = beacon
        self.tier = tier
        self.restart = Restart.from_env()

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
    return Supervised(link, beacon, HostTier(link, reply))


@contextlib.contextmanager
def busy(sup: Supervised | None, kind: str) -> Iterator[None]:
    """Mark this rank busy (not hung) for the supervisor, when there is one."""
    if sup is None:
        yield
        return
    with sup.beacon.busy(kind):
        yield
