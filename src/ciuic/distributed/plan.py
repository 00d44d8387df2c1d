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

import contextlib
import importlib
import logging
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ciuic.errors import ConfigurationError
from ciuic.format import canonical
from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.digest import digest
from ciuic.format.shards import Meta, balanced, meta_of, piece_key, ruled
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
_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper
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
    #: :func:`ruled_plan`'s answer, once asked (the staging's prediction, then the plan)
    ruled: tuple[tuple[str, dict[str, int]] | None] | None = None
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
    """What this rank tells the plan about its global leaves (computed once per capture); a
    shard's layout class too, so that the layouts' digest changes with a mesh or placements
    (the box table is written anew when it does)."""
    if captured.metas is None:
        captured.metas = [meta_of(leaf) | {"spread": leaf.path in captured.spread}
                          | ({"sharding": leaf.sharding} if leaf.sharding else {})
                          for leaf in captured.global_leaves]
    return captured.metas


def layout_signature(captured: DistCaptured, world_size: int) -> tuple[int, list[Meta]]:
    """What the plan sees of this rank (its global leaves' metas) and the world size: while
    every rank's stays equal (``==``), the plan assigns the same owners. Compared as it is, not
    digested: this runs in the stall, and for 3000 leaves the canonical JSON and its digest cost
    12 ms more than building the metas."""
    return world_size, plan_metas(captured)


def predicted_owned(captured: DistCaptured, rank: int, world_size: int) -> set[str] | None:
    """The pieces this rank will write, predicted without asking the others: the owners by rule
    (:func:`ruled_plan`), which the ranks adopt when every rank's tensors agree. None where the
    rule does not apply (a box whose holders its DTensor does not say, such as one on a
    sub-mesh): the ranks then exchange their metas, and that plan balances otherwise."""
    found = ruled_plan(captured, rank, world_size)
    if found is None:
        return None
    return {key for key, owner in found[1].items() if owner == rank}


def ruled_plan(captured: DistCaptured, rank: int, world_size: int
               ) -> tuple[str, dict[str, int]] | None:
    """The owner of each of this rank's global pieces by rule, computed alone (no rank's metas
    exchanged), and the digest of what every rank must agree on for the rule to hold: each
    global tensor's path, dtype, global shape, layout class (a shard's mesh and placements; none
    for a plain tensor) and whether it is pinned. Equal digests on every rank mean every rank
    holds the same plain tensors and shards alike, so that:

    - a plain tensor (a replica on every rank: DDP, or a module left unsharded) is assigned as
      :func:`~ciuic.format.shards.plan` assigns it from ``world_size`` equal metas (largest
      first, to the rank with the fewest bytes; a pinned buffer to rank 0);
    - a shard's box is written by one of the ranks holding it (:attr:`Leaf.holders`, from its
      mesh and placements), chosen by :func:`~ciuic.format.shards.ruled`.

    None where a shard's holders are not known (or do not include this rank): the plan is then
    made from every rank's metas. Computed once per capture."""
    if captured.ruled is None:
        captured.ruled = (_ruled(captured, rank, world_size),)
    return captured.ruled[0]


def _ruled(captured: DistCaptured, rank: int, world_size: int
           ) -> tuple[str, dict[str, int]] | None:
    agreed: list[list[Any]] = []
    plain: list[tuple[str, int, bool]] = []
    owners: dict[str, int] = {}
    for leaf, meta in zip(captured.global_leaves, plan_metas(captured), strict=True):
        pinned = not meta["spread"]
        agreed.append([leaf.path, meta["dtype"], meta["shape"], leaf.sharding, pinned])
        if leaf.shard is None:
            plain.append((leaf.path, leaf.nbytes, pinned))
        elif leaf.holders is None or rank not in leaf.holders or leaf.sharding is None:
            return None
        else:
            key = leaf_key(leaf)
            owners[key] = ruled(key, leaf.holders, pinned)
    owners |= balanced(plain, world_size)
    agreed.sort(key=lambda x: x[0])
    return digest(canonical.dumps([world_size, agreed])), owners


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _own_hooks(model: torch.nn.Module) -> list[str]:
    """The modules whose state-dict hooks come from outside torch (a framework's or the user's,
    such as torchtitan's fused QKV projection, which splits ``wqkv`` into ``wq``/``wk``/``wv``):
    their state dict may name keys that are no attribute of the module, which DCP's
    ``get_model_state_dict`` cannot map (it raises AttributeError)."""
    found = []
    for name, module in model.named_modules():
        for hook in (*module._state_dict_hooks.values(), *module._state_dict_pre_hooks.values()):
            fn = getattr(hook, "func", hook)  # functools.partial
            if not getattr(fn, "__module__", "torch").startswith("torch."):
                found.append(name or "the model")
                break
    return found


def _dcp_name(model: torch.nn.Module, key: str) -> str:
    """``key`` of ``model.state_dict()`` as DCP names it: without the wrappers' own segments
    (DDP's ``module``, torch.compile's ``_orig_mod``, activation checkpointing's). A segment no
    module has (a key a hook made) is kept as it is."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn.parallel import DistributedDataParallel

    names: list[str] = []
    current: Any = model
    for segment in key.replace(_CHECKPOINT_PREFIX, "").split("."):
        if isinstance(current, DistributedDataParallel) and segment == "module":
            current = current.module
        elif isinstance(current, OptimizedModule) and segment == "_orig_mod":
            current = current._orig_mod
        else:
            names.append(segment)
            current = current._modules.get(segment) if isinstance(
                current, torch.nn.Module) else None
    return ".".join(names)


#: The module whose first import a multi-rank restore or snapshot would otherwise wait on
_STATE_DICT = "torch.distributed.checkpoint.state_dict"


def import_ahead() -> None:
    """Import DCP's state-dict helpers on a thread of their own. Their first import in a
    process takes 0.13 s (the 2-core VM, docs/benchmarks.md); a multi-rank restore starts it
    before its round trips to the store (listing, manifest, body), which it then hides behind.
    The caller's own import waits for it where it has not finished (one import per module),
    and raises whatever it raised."""
    if _STATE_DICT in sys.modules:
        return

    def load() -> None:
        with contextlib.suppress(Exception):  # the caller's import raises it again
            importlib.import_module(_STATE_DICT)

    threading.Thread(target=load, name="ciuic-import", daemon=True).start()


def model_state_dict(model: Any) -> dict[str, Any]:
    """The model's state dict as DCP names it, also for a model with state-dict hooks of its
    own: the state dict is then the model's (its hooks applied, as the framework's own
    checkpoint sees it), named as DCP names parameters. Restoring goes through the model's
    ``load_state_dict``, so its load hooks undo what its state-dict hooks did."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    hooked = _own_hooks(model) if isinstance(model, torch.nn.Module) else []
    return _hooked_state_dict(model, hooked) if hooked else get_model_state_dict(model)


def _hooked_state_dict(model: torch.nn.Module, hooked: list[str]) -> dict[str, Any]:
    """:func:`model_state_dict` of a model whose modules ``hooked`` have state-dict hooks of
    their own."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise ConfigurationError(
            f"{', '.join(hooked[:3])} of this model register state-dict hooks of "
            "their own, which a FullyShardedDataParallel (FSDP1) model cannot snapshot "
            "through DCP: shard it with FSDP2 (torch.distributed.fsdp.fully_shard)")
    return {_dcp_name(model, key): value for key, value in model.state_dict().items()
            if not (isinstance(value, torch.Tensor) and value.is_meta)}


def state_dicts(model: Any, optimizer: Any) -> tuple[Any, Any]:
    """The model's and optimizer's state dicts as DCP names them (either may be None).

    An optimizer without state yet is recorded as its hyperparameters only: DCP would first run
    a zero step to create the state, and a snapshot must not change the training.
    """
    if optimizer is None:
        return (model_state_dict(model) if model is not None else None), None
    if model is None:
        raise ConfigurationError("a multi-rank snapshot names optimizer state by parameter "
                                 "name: pass the model along with the optimizer")
    if not optimizer.state:
        return model_state_dict(model), {"state": {},
                                         "param_groups": _hyperparameters(optimizer)}
    return both_state_dicts(model, optimizer)


def both_state_dicts(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``get_state_dict(model, optimizer)``, also for a model with state-dict hooks of its own
    (:func:`model_state_dict`). An optimizer without state gets it (a zero step at lr 0)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict

    hooked = _own_hooks(model) if isinstance(model, torch.nn.Module) else []
    if hooked:
        return _hooked_state_dict(model, hooked), get_optimizer_state_dict(model, optimizer)
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
