"""What the integrations for loops of one's own share (Accelerate, DeepSpeed): where a data
loader is, kept as a snapshot extra, and put back so that the loader resumes mid-epoch by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from ciuic.errors import ConfigurationError
from ciuic.state.replay import FetchRng

log = logging.getLogger("ciuic")
_classes: dict[type, type] = {}
_SET_CLASS = object.__dict__["__class__"].__set__


def with_iter(base: type, cache: dict[type, type],
              make: Callable[[type], Callable[[Any], Iterator[Any]]]) -> type:
    """A subclass of a loader's class, under the same name, whose ``__iter__`` is
    ``make(base)``; made once per class and ``cache``."""
    if base not in cache:
        cache[base] = type(base.__name__, (base,), {
            "__iter__": make(base), "__module__": base.__module__,
            "__qualname__": base.__qualname__})
    return cache[base]


def _tracked_iter(base: type) -> Callable[[Any], Iterator[Any]]:
    """Passes that go through the loader's tracker."""

    def __iter__(self: Any) -> Iterator[Any]:
        tracker: LoaderPosition = self.__dict__["_ciuic_position"]
        return tracker.iterate(base.__iter__(self))  # type: ignore[attr-defined]

    return __iter__


class LoaderPosition:
    """Where a prepared loader is: its epoch, the batches of the epoch in progress the training
    took, and (through a :class:`FetchRng` on its batch sampler) the RNGs of its order and of
    its fetches. An extra of the snapshot (``state_dict``/``load_state_dict``)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.fetch = FetchRng(skip=True)
        self.hooked = self.fetch.attach_loader(loader)
        self.consumed = 0
        self.passes = 0  # passes completed (the epoch of a loader that does not count them)
        self._resume_at = 0  # batches of the resumed epoch already trained on
        # accelerate's loaders answer __class__ with their base loader's (a property, so that
        # isinstance(loader, DataLoader) holds): set the real class through object's slot
        if "_ciuic_position" not in loader.__dict__:
            _SET_CLASS(loader, with_iter(type(loader), _classes, _tracked_iter))
        loader.__dict__["_ciuic_position"] = self

    @property
    def epoch(self) -> int:
        """The epoch in progress: accelerate's loaders count their passes (``iteration``),
        for the others this tracker does."""
        return int(getattr(self.loader, "iteration", self.passes))

    def iterate(self, inner: Iterator[Any]) -> Iterator[Any]:
        self.consumed, self._resume_at = self._resume_at, 0
        self.fetch.at(self.consumed)
        first = True
        for batch in inner:
            if first and self.fetch.moved_on:  # (said at the pass's first pull) the loop set
                self.consumed = 0  # the next epoch: this pass is that epoch's, from its start
                epoch = self.fetch.sampler_epoch()
                self.passes = self.passes if epoch is None else epoch
            first = False
            self.consumed += 1
            self.fetch.at(self.consumed)
            yield batch
        self.consumed = 0
        self.passes += 1
        self.fetch.at(0)

    def start_over(self) -> None:
        """Forget a restored position (another data split's): the next pass starts at its
        beginning, wherever the loop has set its sampler."""
        self._resume_at = 0
        self.fetch.forget()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "fetch": self.fetch.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not {"epoch", "consumed", "fetch"} <= set(state):
            raise ConfigurationError("not a loader position: expected epoch, consumed, fetch")
        self.passes = int(state["epoch"])
        if hasattr(self.loader, "iteration"):
            self.loader.iteration = int(state["epoch"])
        self.fetch.load_state_dict(state["fetch"])
        self._resume_at = int(state["consumed"]) if self.hooked else 0
        if state["consumed"] and not self.hooked:
            log.warning("loader %s has no batch sampler to skip with: its resumed epoch starts "
                        "over", type(self.loader).__name__)
