"""Does a snapshot fit the live objects? Every check that needs only the saved trees, made
before anything live changes: the model's keys, shapes and dtypes (``module.`` and
``_orig_mod.`` prefixes tolerated), the optimizer's parameter groups and shapes, a state for
every object given, and a ``load_state_dict`` on every extra. A restore that does not fit raises
:class:`~ciuic.errors.StateMismatch` (or :class:`~ciuic.errors.ConfigurationError`) and touches
nothing. Then :class:`Prepared`: a restore read and checked, applied only when told to (every
rank of a torchrun job first prepares).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ciuic.errors import ConfigurationError, StateMismatch
from ciuic.format.info import SnapshotInfo
from ciuic.state.capture import normalize_key


@dataclass
class Prepared:
    """A restore read and checked, not yet applied."""

    apply: Callable[[], None]
    values: dict[str, Any]  # values not loaded into an object (restored_values)


def check_names(info: SnapshotInfo, trees: Mapping[str, Any], model: Any, optimizer: Any,
                extras: Mapping[str, Any]) -> None:
    """Before anything is read: the snapshot holds a state for every object given, and every
    extra can take one."""
    if model is not None and "model" not in trees:
        raise StateMismatch(f"snapshot {info.short_id} holds no model state")
    if optimizer is not None and "optimizer" not in trees:
        raise StateMismatch(f"snapshot {info.short_id} holds no optimizer state")
    missing = [n for n in extras if n not in trees]
    if missing:
        have = ", ".join(sorted(trees)) or "nothing"
        raise StateMismatch(f"snapshot {info.short_id} has no state for {', '.join(missing)} "
                            f"(it has: {have}); pass only objects that were saved")
    for name, obj in extras.items():
        check_loadable(name, obj)


def match_model_state(saved: Mapping[str, Any], target: Mapping[str, torch.Tensor]
                      ) -> dict[str, Any]:
    """Map saved model keys onto the target's, tolerating ``module.``/``_orig_mod.`` prefixes.

    Raises :class:`StateMismatch` listing missing keys, unexpected keys and shape/dtype changes.
    """
    if set(saved) != set(target):
        by_norm = {normalize_key(k): k for k in saved}
        if len(by_norm) == len(saved) and set(by_norm) == {normalize_key(k) for k in target}:
            saved = {t: saved[by_norm[normalize_key(t)]] for t in target}
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
        raise StateMismatch(mismatch_message("model", missing, unexpected, changed))
    return dict(saved)


def mismatch_message(what: str, missing: list[str], unexpected: list[str],
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
