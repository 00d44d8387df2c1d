"""A single-process snapshot restored into the live objects: checked against them from its body
alone (:mod:`~ciuic.restore.match`; a snapshot that does not fit touches nothing), read and
verified, straight into the model's and optimizer's tensors where they can take the bytes as
they are (:mod:`~ciuic.restore.inplace`), else into fresh or lent memory, and returned as a
:class:`~ciuic.restore.match.Prepared` whose ``apply()`` loads the objects. The multi-rank
counterpart is :func:`ciuic.distributed.load.prepare`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ciuic.chain.repo import Repository
from ciuic.format.info import SnapshotInfo
from ciuic.restore.inplace import Targets, live_targets
from ciuic.restore.match import (
    Prepared,
    check_names,
    check_optimizer_state,
    load_object,
    match_model_state,
)
from ciuic.restore.reader import load_trees
from ciuic.restore.sources import BufferFor, Resident
from ciuic.state.capture import set_rng_state

log = logging.getLogger("ciuic")


def prepare_local(repo: Repository, info: SnapshotInfo, trees: dict[str, Any], model: Any,
                  optimizer: Any, extras: dict[str, Any], buffer_for: BufferFor | None,
                  resident: Resident | None = None,
                  reading_into: Callable[[], None] | None = None) -> Prepared:
    """Check a snapshot's ``trees`` (its body) against the live objects, then read and verify
    its bytes. ``reading_into()`` is called before the first byte is read into a live tensor
    (from then on, a failed read leaves part of the snapshot in them)."""
    skip = {n for n, obj in (("model", model), ("optimizer", optimizer)) if obj is None}
    wanted = {k: v for k, v in trees.items() if k not in skip}
    check_names(info, wanted, model, optimizer, extras)
    into = live_targets(wanted, model, optimizer)  # StateMismatch here touches nothing

    def lend(path: str, nbytes: int) -> torch.Tensor | None:
        flat = into.into.get(path)
        if flat is not None:
            return flat
        return buffer_for(path, nbytes) if buffer_for is not None else None

    if into.into and reading_into is not None:
        reading_into()
    states = load_trees(repo, wanted, lend, resident=resident)
    return _loader(states, model, optimizer, extras, into)


def _loader(states: dict[str, Any], model: Any, optimizer: Any, extras: dict[str, Any],
            targets: Targets) -> Prepared:
    """Check the states read against the live objects (their names were checked before
    reading: ``check_names``), and return how to load them."""
    model_state = None
    if model is not None:
        model_state = match_model_state(states["model"], model.state_dict())
    if optimizer is not None:
        check_optimizer_state(states["optimizer"], optimizer)

    def apply() -> None:
        # extras first: their load_state_dict may still reject the state (a sampler over a
        # dataset of another length), and then the model and optimizer are untouched
        for name, obj in extras.items():
            load_object(name, obj, states[name])
        if model is not None:
            log.info("Loading model state...")
            model.load_state_dict(model_state)
        if optimizer is not None:
            log.info("Loading optimizer state...")
            targets.keep_held(states["optimizer"])
            optimizer.load_state_dict(states["optimizer"])
        if "rng" in states:
            set_rng_state(states["rng"])

    values = {k: v for k, v in states.items()
              if k not in ("model", "optimizer", "rng") and k not in extras}
    return Prepared(apply, values)
