"""The pipeline under torchrun: every rank captures through DCP's state-dict API, copies only
the replicas it will write, and takes part in the two-phase commit
(:mod:`ciuic.distributed.save`).

Replica ownership: a replicated tensor (DDP) is written by one rank only. When this rank's
layout is the one of the previous snapshot, the plan assigns the same owners; before that, for
plain (DDP) layouts, they are predicted locally. So the replicas other ranks write are not
copied here: the stall and the staging memory of a DDP rank shrink by the world size. After a
failed snapshot the next one copies everything (no prediction) and learns the owners from the
plan.
"""

from __future__ import annotations

import logging
from typing import Any

from ciuic.distributed.messages import Plans
from ciuic.distributed.plan import (
    DistCaptured,
    capture_dist,
    layout_signature,
    leaf_key,
    predicted_owned,
)
from ciuic.distributed.save import write_dist
from ciuic.errors import CaptureError
from ciuic.format import manifest as mf
from ciuic.format.shards import Meta
from ciuic.format.tree import Leaf
from ciuic.manager.pipeline import Pipeline

log = logging.getLogger("ciuic")


class RankedPipeline(Pipeline[DistCaptured]):
    """Every rank of a torchrun job (see the module's docstring)."""

    #: (this rank's layout signature, the pieces it wrote) of the last committed snapshot
    _owned: tuple[tuple[int, list[Meta]], set[str]] | None = None
    _predict = True  # off for the snapshot after a failed one
    _seq = 0  # snapshots attempted: every rank counts the same
    #: the last plan (owners) and the layouts it was made for: unchanged, it is not remade
    _plans: Plans | None = None

    def plans(self) -> Plans:
        """This rank's cache of the last plan (made at the first snapshot)."""
        if self._plans is None:
            self._plans = Plans()
        return self._plans

    def adopt_plan(self, joint: str, others: dict[str, int]) -> None:
        # the restored snapshot's owners: after a restart on the same layout the first snapshot
        # exchanges digests, not every rank's metas (W x T of them per rank)
        self._plans = Plans(joint=joint, owners=dict(others), default=self.coll.rank)

    def capture(self, model: Any, optimizer: Any, extras: dict[str, Any]) -> DistCaptured:
        return capture_dist(model, optimizer, extras)

    def to_stage(self, captured: DistCaptured) -> list[Leaf]:
        world = self.coll.world_size
        captured.signature = layout_signature(captured, world)
        if self._owned is not None and self._owned[0] == captured.signature:
            owned: set[str] | None = self._owned[1]
        elif self._predict:  # the first snapshot, or a new layout: the owners by rule
            owned = predicted_owned(captured, self.coll.rank, world)
            plans = self._plans
            if owned is not None and plans is not None and plans.default is not None:
                # after a restore on the same world size the commit keeps the restored plan
                # while the layout is the one it was made for (an older ciuic's may not be
                # the rule's), and plans by rule otherwise: what either has this rank write
                owned |= {key for leaf in captured.global_leaves
                          if plans.owner(key := leaf_key(leaf)) == self.coll.rank}
        else:
            owned = None
        if owned is None:
            return captured.leaves
        captured.unstaged = {leaf_key(leaf) for leaf in captured.global_leaves} - owned
        return captured.to_stage()

    def capture_failed(self, e: Exception) -> DistCaptured:
        # every rank must still take part in this snapshot's collectives; the failure travels
        # in the plan, and every rank fails the snapshot together
        if isinstance(e, CaptureError):  # raised later, from the plan's text: its traceback now
            log.error("%s", e, exc_info=e.__cause__ or e)
        return DistCaptured(states={}, leaves=[], error=f"{type(e).__name__}: {e}")

    def write(self, step: int, captured: DistCaptured) -> tuple[mf.Manifest, str, int]:
        self._seq += 1
        return write_dist(self.coll, self.snapshot_write(step), captured, seq=self._seq,
                          plans=self.plans())

    def written(self, captured: DistCaptured, ok: bool) -> None:
        if not ok:
            self._owned = None  # the next snapshot copies everything
            self._predict = False
            return
        self._owned = (None if captured.signature is None
                       else (captured.signature, captured.owned))
        self._predict = True
