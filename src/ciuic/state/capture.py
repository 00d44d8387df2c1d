"""Training state <-> trees: model, optimizer, extras, RNG (docs/format.md, "State names").

Capture does no I/O: it asks each object for its ``state_dict()`` and encodes the result into a
tree whose tensors are referenced, not copied (the writer or the engine copies them).
Restore validates everything against the live objects before it changes any of them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ciuic.errors import CaptureError, ConfigurationError, StateMismatch
from ciuic.format.tree import Leaf, encode

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
            log.warning("the snapshot holds CUDA RNG states for %d device(s) but %d are visible: "
                        "CUDA RNG states were not restored, so random draws on the GPU will "
                        "differ from the original run", len(cuda), torch.cuda.device_count())


def _normalize(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if key.startswith(p):
                key, changed = key[len(p):], True
            if f".{p}" in key:
                key, changed = key.replace(f".{p}", "."), True
    return key


def match_model_state(saved: Mapping[str, Any], target: Mapping[str, torch.Tensor]
                      ) -> dict[str, Any]:
    """Map saved model keys onto the target's, tolerating ``module.``/``_orig_mod.`` prefixes.

    Raises :class:`StateMismatch` listing missing keys, unexpected keys and shape/dtype changes.
    """
    if set(saved) != set(target):
        by_norm = {_normalize(k): k for k in saved}
        if len(by_norm) == len(saved) and set(by_norm) == {_normalize(k) for k in target}:
            saved = {t: saved[by_norm[_normalize(t)]] for t in target}
    missing = sorted(set(target) - set(saved))
    unexpected = sorted(set(saved) - set(target))
    changed = []
    for k in sorted(set(saved) & set(target)):
        s, t = saved[k], target[k]
        if isinstance(s, torch.Tensor) and isinstance(t, torch.Tensor) and (
                s.shape != t.shape or s.dtype != t.dtype):
            changed.append(f"{k}: snapshot {s.dtype} {tuple(s.shape)}, "
                           f"model {t.dtype} {tuple(t.shape)}")
    if missing or unexpected or changed:
        raise StateMismatch(_mismatch_message("model", missing, unexpected, changed))
    return dict(saved)


def _mismatch_message(what: str, missing: list[str], unexpected: list[str],
                      changed: list[str]) -> str:
    def show(items: list[str]) -> str:
        head = ", ".join(items[:20])
        return head + (f", ... ({len(items) - 20} more)" if len(items) > 20 else "")

    parts = [f"the snapshot does not fit this {what}:"]
    if missing:
        parts.append(f"  missing from the snapshot ({len(missing)}): {show(missing)}")
    if unexpected:
        parts.append(f"  in the snapshot but not in the {what} ({len(unexpected)}): "
                     f"{show(unexpected)}")
    if changed:
        parts.append(f"  different shape or dtype ({len(changed)}): {show(changed)}")
    parts.append("Restore into the same architecture the snapshot was taken from, or pick "
                 "another snapshot (`ciuic show SNAP` lists its tensors).")
    return "\n".join(parts)


def check_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`StateMismatch` unless ``saved`` fits ``optimizer``'s parameter groups."""
    if not isinstance(saved, Mapping) or "param_groups" not in saved or "state" not in saved:
        raise StateMismatch("the snapshot's optimizer state is not a torch optimizer state_dict")
    groups = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        raise StateMismatch(
            f"the snapshot's optimizer has {len(saved_groups)} parameter groups, this one has "
            f"{len(groups)}; build the optimizer the same way as the run that saved it"
        )
    problems = []
    ids: list[Any] = []
    params: list[torch.Tensor] = []
    for i, (sg, g) in enumerate(zip(saved_groups, groups, strict=True)):
        if len(sg["params"]) != len(g["params"]):
            problems.append(f"group {i}: {len(sg['params'])} parameters in the snapshot, "
                            f"{len(g['params'])} here")
        ids.extend(sg["params"])
        params.extend(g["params"])
    if not problems:
        by_id = dict(zip(ids, params, strict=True))
        for pid, st in saved["state"].items():
            p = by_id.get(pid)
            if p is None:
                problems.append(f"state for unknown parameter {pid}")
                continue
            for name, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != p.shape:
                    problems.append(f"param {pid} {name}: {tuple(v.shape)} vs parameter "
                                    f"{tuple(p.shape)}")
    if problems:
        raise StateMismatch("the snapshot's optimizer state does not fit this optimizer: "
                            + "; ".join(problems[:20]))


def check_loadable(name: str, obj: Any) -> None:
    """Raise unless ``obj`` can take a state through ``load_state_dict``."""
    if not callable(getattr(obj, "load_state_dict", None)):
        raise ConfigurationError(
            f"cannot restore {name!r}: a {type(obj).__name__} has no load_state_dict(); plain "
            "values come back in manager.restored_values"
        )


def load_object(name: str, obj: Any, value: Any) -> None:
    """Load ``value`` into an extra state object through its ``load_state_dict``."""
    check_loadable(name, obj)
    try:
        obj.load_state_dict(value)
    except Exception as e:
        raise StateMismatch(f"{name}.load_state_dict() rejected the snapshot's state: {e}") from e
