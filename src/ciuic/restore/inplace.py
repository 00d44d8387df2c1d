"""Restore straight into the live tensors: which leaf of a snapshot is read into which tensor the
model and the optimizer already hold.

A restore that read into fresh memory and then copied (``load_state_dict``) would pay twice:
once for the kernel to hand it fresh pages, once for the copy. Reading each chunk into the
tensor it belongs to pays neither (docs/architecture.md, "Restore"). Before any byte is read,
everything that can be checked without the bytes is checked against the live objects, from the
snapshot's body alone: the model's keys, shapes and dtypes (``match_model_state``), the
optimizer's groups and shapes (``check_optimizer_state``). A snapshot that does not fit so
touches nothing.

A tensor is read into only when the read can land in it as it is: on the CPU, contiguous, of the
descriptor's dtype and shape, a plain tensor (or parameter), not backed by a file (a memory map
could be read-only), and not overlapping a tensor already taken (tied weights are read once into
their memory and the second path reads into fresh memory, as before). Anything else is read into
fresh memory (or the staging buffers the pipeline lends) and copied by ``load_state_dict`` as
before; the optimizer's state is then copied into the tensors it holds (on a GPU: no second
allocation of the optimizer's state while the first is alive). Extras are never read into: their
``load_state_dict`` decides what happens to their state.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.tree import decode
from ciuic.restore.leaves import leaf_layout
from ciuic.restore.match import check_optimizer_state, match_model_state


class _Placeholders:
    """Meta tensors standing for a body's tensor leaves (shape and dtype, no bytes), and the path
    of each one whose bytes are in chunks (the leaves a read can land in a live tensor)."""

    def __init__(self) -> None:
        self.paths: dict[int, str] = {}
        self._kept: list[torch.Tensor] = []  # ids stay unique while the placeholders live

    def leaf(self, path: str, kind: str, desc: dict[str, Any]) -> Any:
        if kind != "tensor":
            return None  # arrays and NumPy scalars: the structure checks compare tensors only
        typed = TensorDescriptor.from_json(desc, path)
        dtype, shape = leaf_layout(path, kind, typed)
        t = torch.empty(shape, dtype=dtype, device="meta")
        self._kept.append(t)
        if typed.chunks is not None:
            self.paths[id(t)] = path
        return t

    def path(self, value: Any) -> str | None:
        return self.paths.get(id(value)) if isinstance(value, torch.Tensor) else None


class _Taken:
    """Byte ranges of host memory already chosen as read targets (no two reads overlap)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def claim(self, start: int, nbytes: int) -> bool:
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._ends[i - 1] > start:
            return False
        if i < len(self._starts) and self._starts[i] < start + nbytes:
            return False
        self._starts.insert(i, start)
        self._ends.insert(i, start + nbytes)
        return True


def _readable_into(live: Any, like: torch.Tensor) -> bool:
    if type(live) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if (live.device.type != "cpu" or live.dtype != like.dtype or live.shape != like.shape
            or not live.is_contiguous() or live.numel() == 0):
        return False
    return getattr(live.untyped_storage(), "filename", None) is None


@dataclass
class Targets:
    """Where a snapshot's bytes go in the live objects."""

    #: leaf path -> a flat byte view of the live tensor the leaf is read straight into
    into: dict[str, torch.Tensor] = field(default_factory=dict)
    #: (parameter ID in the snapshot, name) -> the optimizer's live state tensor of that shape
    #: and dtype: the loaded value is copied into it (when not read into it already) and the
    #: optimizer keeps it, so its memory (on a GPU too) is not allocated a second time
    held: dict[tuple[Any, str], torch.Tensor] = field(default_factory=dict)

    def keep_held(self, optimizer_state: Mapping[str, Any]) -> None:
        """Put the optimizer's own tensors, holding the loaded values, in its loaded state."""
        state = optimizer_state["state"]
        for (pid, name), live in self.held.items():
            loaded = state[pid][name]
            if loaded.data_ptr() != live.data_ptr():
                live.copy_(loaded)
            state[pid][name] = live


def live_targets(trees: Mapping[str, Any], model: Any, optimizer: Any) -> Targets:
    """Check a snapshot's model and optimizer trees against the live objects (raising
    :class:`~ciuic.errors.StateMismatch` before anything is read) and say where its bytes go."""
    marks = _Placeholders()
    out = Targets()
    pairs: list[tuple[str, torch.Tensor, Any]] = []  # path, placeholder, live tensor
    if model is not None and "model" in trees:
        saved = decode(trees["model"], "model", marks.leaf, adapt=False)
        if isinstance(saved, Mapping):
            live = model.state_dict()
            for key, value in match_model_state(saved, live).items():
                if (path := marks.path(value)) is not None:
                    pairs.append((path, value, live[key]))
    if optimizer is not None and "optimizer" in trees:
        saved = decode(trees["optimizer"], "optimizer", marks.leaf, adapt=False)
        check_optimizer_state(saved, optimizer)
        ids = [pid for group in saved["param_groups"] for pid in group["params"]]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        by_id = dict(zip(ids, params, strict=True))
        for pid, values in saved["state"].items():
            held = optimizer.state.get(by_id[pid], {})
            for name, value in values.items():
                live = held.get(name)
                if (isinstance(value, torch.Tensor) and type(live) is torch.Tensor
                        and live.shape == value.shape and live.dtype == value.dtype):
                    out.held[pid, name] = live
                    if (path := marks.path(value)) is not None:
                        pairs.append((path, value, live))
    taken = _Taken()
    for path, like, live in pairs:
        if not _readable_into(live, like):
            continue
        flat = live.detach().reshape(-1).view(torch.uint8)
        if taken.claim(flat.data_ptr(), flat.numel()):
            out.into[path] = flat
    return out
