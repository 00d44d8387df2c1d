"""Training state <-> trees: model, optimizer, extras, RNG (docs/format.md, "State names").

Capture does no I/O: it asks each object for its ``state_dict()`` and encodes the result into a
tree whose tensors are referenced, not copied (the writer or the engine copies them). Putting a
snapshot's state back into live objects, and checking first that it fits them, is
:mod:`ciuic.restore.match`'s; the RNG state is set here (:func:`set_rng_state`), the inverse of
:func:`rng_state`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ciuic.errors import CaptureError, ConfigurationError
from ciuic.format.tree import Leaf, encode
from ciuic.words import counted

log = logging.getLogger("ciuic")
RESERVED = ("rng", "ranks", "dist")  # "ranks", "dist": multi-rank bodies (ciuic.distributed)
_PREFIXES = ("_orig_mod.", "module.")


@dataclass
class Captured:
    """A state captured for one snapshot: encoded trees plus the tensors they reference."""

    states: dict[str, Any]
    leaves: list[Leaf]
    metrics: dict[str, Any] = field(default_factory=dict)


def _state_of(name: str, obj: Any) -> Any:
    fn = getattr(obj, "state_dict", None)
    if callable(fn):
        return fn()
    if isinstance(obj, torch.utils.data.DataLoader):
        raise CaptureError(
            f"extra {name!r} is a DataLoader, which keeps no position to snapshot (neither how "
            "far its epoch went nor the state its order is drawn from). Give it a "
            "ciuic.ResumableSampler (DataLoader(..., sampler=sampler)) and pass the sampler "
            "instead, or use torchdata's StatefulDataLoader")
    if isinstance(obj, torch.utils.data.DistributedSampler):
        raise CaptureError(
            f"extra {name!r} is a DistributedSampler, which keeps no position in its epoch. "
            "Replace it with ciuic.ResumableSampler(dataset, shuffle=..., seed=..., "
            "num_replicas=..., rank=..., drop_last=...): the same arguments give every rank "
            "the same indices in the same order, set_epoch() included, and it resumes "
            "mid-epoch")
    return obj


def capture(model: Any = None, optimizer: Any = None, extras: Mapping[str, Any] | None = None,
            *, rng: bool = True) -> Captured:
    """Capture the state of the given objects (references to live tensors; no copies, no I/O)."""
    leaves: list[Leaf] = []
    states: dict[str, Any] = {}
    metrics: dict[str, Any] = {}
    if model is not None:
        states["model"] = encode(_state_of("model", model), "model", leaves)
    if optimizer is not None:
        states["optimizer"] = encode(_state_of("optimizer", optimizer), "optimizer", leaves)
    for name, obj in (extras or {}).items():
        if name in ("model", "optimizer", *RESERVED):
            raise ConfigurationError(f"extra state name {name!r} is reserved; choose another")
        if isinstance(obj, (int, float, np.integer, np.floating)) and not isinstance(obj, bool):
            metrics[name] = float(obj) if isinstance(obj, (float, np.floating)) else int(obj)
        states[name] = encode(_state_of(name, obj), name, leaves)
    if rng:
        states["rng"] = encode(rng_state(), "rng", leaves)
    return Captured(states=states, leaves=leaves, metrics=metrics)


def rng_state() -> dict[str, Any]:
    """Every global RNG this process uses: Python, NumPy's legacy global, torch CPU, CUDA."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    if "python" in state:
        v = state["python"]
        random.setstate((v[0], tuple(v[1]), v[2]))
    if "numpy" in state:
        np.random.set_state(tuple(state["numpy"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = list(state["cuda"])
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            visible = torch.cuda.device_count()
            log.warning("the snapshot holds CUDA RNG states for %s but %d %s visible: CUDA RNG "
                        "states were not restored, so random draws on the GPU will differ from "
                        "the original run", counted(len(cuda), "device"), visible,
                        "is" if visible == 1 else "are")


def normalize_key(key: str) -> str:
    """A model key without the prefixes ``torch.compile`` (``_orig_mod.``) and DDP (``module.``)
    add, anywhere in it."""
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p):], True
            if f".{p}" in key:
                key, changed = key.replace(f".{p}", "."), True
    return key


def _environment_faults() -> tuple[type[BaseException], ...]:
    faults: list[type[BaseException]] = [OSError, TimeoutError, MemoryError]
    for owner, name in ((torch, "OutOfMemoryError"), (torch.distributed, "DistError")):
        kind = getattr(owner, name, None)
        if isinstance(kind, type) and issubclass(kind, BaseException):
            faults.append(kind)
    return tuple(faults)


def as_capture_error(e: Exception) -> Exception:
    """What capturing the state raised, as the snapshot reports it. Capture does no I/O: an
    exception there (a state_dict() or a state-dict hook that raises, a value that cannot be
    stored) comes from the state itself and fails the same way at every snapshot, so it is a
    :class:`CaptureError`, raised to the caller rather than logged at every interval while
    the job trains without snapshots. A fault of the environment (memory, a collective a
    state-dict hook runs, the OS) stays what it is: a failed snapshot, and training goes on."""
    if isinstance(e, (CaptureError, ConfigurationError, *_environment_faults())):
        return e
    return CaptureError(  # (raised from ``e``)
        f"capturing the state for the snapshot failed: {type(e).__name__}: {e}. It fails the "
        "same way at every snapshot, so it is raised rather than leave the job training "
        "without snapshots: its traceback (on the rank that raised it) shows which "
        "state_dict() or state-dict hook raised it")

