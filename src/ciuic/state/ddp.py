"""One gradient bucket layout for every run of a DistributedDataParallel job.

DDP packs the gradients into buckets, reduced one allreduce per bucket. It builds the buckets in
reverse parameter order, then rebuilds them once, at the second forward, in the order the
gradients became ready during the first backward. A process that resumes from a snapshot builds
a new DDP, so its first step reduces in the initial layout where the uninterrupted run, at that
step, used the rebuilt one. An element's place in its bucket decides the order in which a ring
allreduce adds the ranks' values: with two ranks the sum is the same either way (a + b == b + a),
with more it differs in the last bits, and the resumed run is no longer bit-identical.

:func:`pin_buckets` fixes the layout before the first forward, on every rank: the parameters'
order, never rebuilt. ``SnapshotManager.restore()`` calls it, also when there is nothing to
restore, so the uninterrupted run and every resumed one reduce in the same layout from the first
step on.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("ciuic")


def pin_buckets(model: Any) -> bool:
    """Pin a DDP model's bucket layout (every rank must call this, before the model's first
    forward). Returns whether it did: False for a model that is not DDP, a DDP that ran a
    forward already (a rollback in the running process keeps its layout; a resumed run must
    restore before its first forward, as the quick start does) or one with a static graph."""
    import torch

    ddp = torch.nn.parallel.DistributedDataParallel
    if not isinstance(model, ddp) or getattr(model, "static_graph", False):
        return False
    if (getattr(model, "_lazy_init_ran", True) or getattr(model, "_has_rebuilt_buckets", True)
            or getattr(model, "_ciuic_pinned", False)):
        return False  # it ran a forward (its layout is DDP's by now), or it is pinned
    reducer = getattr(model, "reducer", None)
    try:
        reducer._push_all_rebuilt_params()  # type: ignore[union-attr]
        rebuilt = bool(reducer._rebuild_buckets())  # type: ignore[union-attr]
    except (AttributeError, RuntimeError) as e:  # a torch without these: resumes may drift
        log.warning("could not fix DistributedDataParallel's gradient bucket layout (%s): with "
                    "more than 2 ranks a resumed run may differ from an uninterrupted one in the "
                    "last bits", e)
        return False
    # as DDP's own forward does after a rebuild; and not twice
    vars(model).update(_has_rebuilt_buckets=rebuilt, _ciuic_pinned=True)
    return rebuilt
