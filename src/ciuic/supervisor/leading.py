"""What the leader of a job of several nodes (node 0's ``ciuic run --nproc-per-node``) learns
of the other nodes, and how it fills a lost node's place (:mod:`ciuic.supervisor.fleet`): a
part of :class:`~ciuic.supervisor.launch.Launcher`."""

from __future__ import annotations

import logging
import time
from typing import Any

from ciuic.supervisor import inprocess as ip
from ciuic.supervisor.causes import Cause
from ciuic.supervisor.fleet import PLACE, LeaderLink, Member

log = logging.getLogger("ciuic.run")
#: how long the leader waits, at the job's end, for the other nodes' ciuic run to end (their
#: ranks read the control store it hosts until they exit)
FOLLOWERS_WAIT_S = 30.0


class Leading:
    """The leader's part of the launcher (a mixin: the launcher's control store, generation
    and link)."""

    control: Any
    gen: int
    nproc: int
    nnodes: int
    world: int
    link: LeaderLink | None
    _vacant: dict[int, int]

    def _known_elsewhere(self) -> bool:
        """Another node reported a rank's death, or was lost (the node link)."""
        if self.link is None:
            return False
        return (any(m.slot is not None and m.lost is not None and not m.said
                    for m in self.link.members)
                or int(self.control.add(ip.DEATHS + str(self.gen), 0)) > 0)

    def _lost_nodes(self) -> list[Member]:
        """The nodes holding a slot lost since the last call (a spare node lost is said)."""
        if self.link is None:
            return []
        out = []
        for m in self.link.lost():
            # its place is not its own any more: its ciuic run, started again, waits for one
            self.control.delete_key(PLACE + str(m.node_rank))
            if m.slot is None:
                log.warning("ciuic run: %s %s lost: %s", "spare" if m.node_rank >= self.nnodes
                            else "not yet placed", m, m.lost)
            else:
                out.append(m)
        return out

    def _elsewhere(self, hung: Cause | None) -> Cause | None:
        """A fault another node's ciuic run reported in this generation: a hang of its
        ranks, or a rank that died (its text says how)."""
        if self.link is None or hung is not None:
            return None
        g = str(self.gen)
        if self.control.check([ip.HUNG + g]):
            return Cause("hang", self.control.get(ip.HUNG + g).decode())
        if int(self.control.add(ip.DEATHS + g, 0)) == 0:
            return None
        keys = [f"{ip.DIED}{g}/{r}" for r in range(self.world)]
        end = time.monotonic() + 1.0  # the count is added before the text is set
        while True:
            said = []
            for k in keys:
                if self.control.check([k]):
                    order, kind, text = self.control.get(k).decode().split(" ", 2)
                    said.append((int(order), kind, text))
            if said or time.monotonic() >= end:
                break
            time.sleep(0.01)
        if not said:
            return None
        _, kind, text = min(said)
        return Cause(kind, text)

    def _died_elsewhere(self) -> set[int]:
        """The ranks another node reported dead in this generation."""
        return {r for r in range(self.world)
                if self.control.check([f"{ip.DIED}{self.gen}/{r}"])}

    def _fill_vacant(self) -> None:
        """Give each slot without a node (at the start; after a node's loss) to a node that
        joined: at the start, the node of that rank; after a loss, a spare node (or the lost
        node's ciuic run started again). The node starts the slot's ranks in the current
        generation."""
        if self.link is None:
            return
        for slot, since in sorted(self._vacant.items()):
            m = self.link.take(slot, exact=since < 0, spare_from=self.nnodes)
            if m is None:
                continue
            gen = max(since, self.gen)
            del self._vacant[slot]
            self.control.set(ip.SLOT + str(slot), str(m.node_rank))
            self.control.set(PLACE + str(m.node_rank), f"{slot} {gen}")
            if since >= 0:
                log.warning("ciuic run: %s takes node %d's place (%s) in generation %d", m,
                            slot, self._ranks_text(slot), gen)

    def _ranks_text(self, slot: int) -> str:
        first = slot * self.nproc
        return (f"rank {first}" if self.nproc == 1 else
                f"ranks {first}-{first + self.nproc - 1}")

    def _wait_followers(self, within_s: float = FOLLOWERS_WAIT_S) -> None:
        """At the job's end: wait until every other node's ciuic run has ended (its ranks
        have read the end from the control store, which ends with this process; an
        emergency snapshot's ranks are given ``within_s``)."""
        if self.link is None:
            return
        end = time.monotonic() + within_s
        while time.monotonic() < end and self.link.live():
            time.sleep(0.05)
        if self.link.live():
            log.warning("ciuic run: %s still running %g s after the job's end; ending",
                        ", ".join(map(str, self.link.live())), within_s)
