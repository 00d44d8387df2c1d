"""Multi-rank capture and the plan: what each rank captures (global states through DCP's
state-dict API, per-rank states as usual) and which rank writes which piece.

The model and optimizer go through ``torch.distributed.checkpoint.state_dict.get_state_dict``:
parameter names without ``module.`` prefixes, optimizer state keyed by parameter name, and
DTensors for sharded state (FSDP2, tensor parallel). These are the **global states**. RNG and
every extra (data position, scheduler, user objects) are **per-rank states**. The plan
(:func:`ciuic.format.shards.plan`) has replicas written once and spreads the writing across
ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ciuic.errors import ConfigurationError
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.shards import Meta, meta_of, piece_key, plan
from ciuic.format.tree import (
    Leaf,
    encode,
    join,
)
from ciuic.state.capture import (
    Captured,
    capture,
    normalize_key,
)

log = logging.getLogger("ciuic")


GLOBAL = ("model", "optimizer")
LAYOUT = "dcp-fqn"  # model and optimizer as get_state_dict names them


@dataclass
class DistCaptured(Captured):
    """A multi-rank capture: ``global_leaves`` belong to the model/optimizer states."""

    global_leaves: list[Leaf] = field(default_factory=list)
    rank_names: list[str] = field(default_factory=list)
    #: set when this rank failed before the commit protocol (capture, staging): the rank still
    #: takes part, reporting the error, so every rank fails the snapshot together
    error: str | None = None
    #: paths of replicated tensors any holder may write (parameters and optimizer state, equal
    #: on every rank by construction); other replicas (buffers such as BatchNorm statistics,
    #: which DDP only re-broadcasts at the next forward) are written by the lowest rank
    spread: set[str] = field(default_factory=set)
    #: what the plan is told of this rank's global leaves (:func:`plan_metas`)
    metas: list[Meta] | None = None
    #: the layout of this rank's global leaves (:func:`layout_signature`)
    signature: tuple[int, list[Meta]] | None = None
    #: piece keys of global leaves left unstaged (their values are the live tensors): the
    #: previous snapshot with the same layout on this rank had other ranks write them
    unstaged: set[str] = field(default_factory=set)
    #: set by :func:`write_dist`: the piece keys this rank wrote under the plan
    owned: set[str] = field(default_factory=set)
    #: set by :func:`write_dist`: the descriptor of each leaf this rank wrote, by path, as
    #: written (the coordinator's commit then describes its global leaves anew)
    written: dict[str, TensorDescriptor] = field(default_factory=dict)

    def to_stage(self) -> list[Leaf]:
        """The leaves to copy into staging buffers: all but the unstaged replicas."""
        if not self.unstaged:
            return self.leaves
        skip = {id(leaf) for leaf in self.global_leaves if leaf_key(leaf) in self.unstaged}
        return [leaf for leaf in self.leaves if id(leaf) not in skip]


def leaf_key(leaf: Leaf) -> str:
    """The plan's key of a global leaf (its path, plus the box's offsets for a shard)."""
    return piece_key(leaf.path, leaf.shard[1] if leaf.shard else None)


def plan_metas(captured: DistCaptured) -> list[Meta]:
    """What this rank tells the plan about its global leaves (computed once per capture)."""
    if captured.metas is None:
        captured.metas = [meta_of(leaf) | {"spread": leaf.path in captured.spread}
                          for leaf in captured.global_leaves]
    return captured.metas


def layout_signature(captured: DistCaptured, world_size: int) -> tuple[int, list[Meta]]:
    """What the plan sees of this rank (its global leaves' metas) and the world size: while
    every rank's stays equal (``==``), the plan assigns the same owners. Compared as it is, not
    digested: this runs in the stall, and for 3000 leaves the canonical JSON and its digest cost
    12 ms more than building the metas."""
    return world_size, plan_metas(captured)


def predicted_owned(captured: DistCaptured, rank: int, world_size: int) -> set[str] | None:
    """The pieces this rank will write, predicted without asking the others, when every global
    leaf is a plain tensor (DDP, replicated modules): every rank then holds the same layout
    (the plan refuses anything else), so the plan is this rank's metas times the world size.
    None for sharded layouts (which rank holds which box is not known locally)."""
    if any(leaf.shard is not None for leaf in captured.global_leaves):
        return None
    owners = plan([plan_metas(captured)] * world_size)
    return {key for key, owner in owners.items() if owner == rank}


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def state_dicts(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """The model's and optimizer's state dicts as DCP names them (either may be None).

    An optimizer without state yet is recorded as its hyperparameters only: DCP would first run
    a zero step to create the state, and a snapshot must not change the training.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return (get_model_state_dict(model) if model is not None else None), None
    if model is None:
        raise ConfigurationError("a multi-rank snapshot names optimizer state by parameter "
                                 "name: pass the model along with the optimizer")
    if not optimizer.state:
        return get_model_state_dict(model), {"state": {},
                                             "param_groups": _hyperparameters(optimizer)}
    return get_state_dict(model, optimizer)


def capture_dist(model: Any, optimizer: Any, extras: Mapping[str, Any]) -> DistCaptured:
    """Capture (references, no copies): global states through DCP, per-rank states as usual."""
    own = capture(None, None, extras)
    msd, osd = state_dicts(model, optimizer)
    leaves: list[Leaf] = []
    states: dict[str, Any] = {}
    spread: set[str] = set()
    if msd is not None:
        states["model"] = encode(msd, "model", leaves)
        params = {normalize_key(n) for n, _ in model.named_parameters()} if isinstance(
            model, torch.nn.Module) else set()
        spread = {join("model", k) for k in msd if normalize_key(k) in params}
    if osd is not None:
        states["optimizer"] = encode(osd, "optimizer", leaves)
        spread |= {leaf.path for leaf in leaves if leaf.path.startswith("optimizer/")}
    return DistCaptured(states={**states, **own.states}, leaves=leaves + own.leaves,
                        metrics=own.metrics, global_leaves=leaves, rank_names=list(own.states),
                        spread=spread)
