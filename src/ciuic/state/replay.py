"""The RNG at each batch fetch, recorded and replayed: bit-exact data augmentation on resume.

A dataset that draws its augmentation from the global RNGs (``torch.rand`` in
``__getitem__``) ties each batch to the RNG state at the moment it was fetched. Loaders fetch
ahead of the training step (accelerate's ``DataLoaderShard`` fetches one batch ahead, a
``Trainer`` with gradient accumulation several), so when a snapshot is taken after step N the
batches N+1.. may already be fetched, from RNG states older than the snapshot's. Restoring the
snapshot's RNG before the resumed loader fetches them again gives other augmentations than the
uninterrupted run had: this is how Hugging Face's resume differs (transformers #39215), on top of
restoring the RNG only after the first resumed batch is drawn.

:class:`FetchRng` hooks a loader's batch sampler (the point just before each fetch) and keeps
the RNG state at each of the last fetches, and at the start of the pass. Its state in a snapshot
is the states of the batches fetched but not yet trained on, and the pass's start. On resume, the
next pass starts from that start state (a sampler drawing its order from the global RNG draws
the same order), sets each pending state again just before its batch is fetched, and after them
the snapshot's own RNG (the state at the snapshot, which the uninterrupted run continued from).
A snapshot taken at the end of a pass sets the snapshot's RNG when the next pass starts, before
the loader draws its seed. With ``skip``, the batches consumed before the snapshot are not
handed out again (for loaders that do not skip them themselves).

Exact for map-style datasets loaded in the main process (``num_workers=0``). Worker processes
draw from their own RNGs, seeded by the loader: their streams are not replayed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

from ciuic.errors import ConfigurationError
from ciuic.state.capture import rng_state, set_rng_state
from ciuic.words import counted

log = logging.getLogger("ciuic")
_KEEP = 256  # fetches remembered: more than any loader's look-ahead plus accumulation
_classes: dict[type, type] = {}


def _hooked_class(base: type) -> type:
    """A subclass of ``base`` whose ``__iter__`` goes through the instance's recorder."""
    if base in _classes:
        return _classes[base]

    def __iter__(self: Any) -> Iterator[Any]:
        recorder: FetchRng = self.__dict__["_ciuic_fetch_rng"]
        return recorder.iterate(base.__iter__(self))  # type: ignore[attr-defined]

    cls = type(base.__name__, (base,), {"__iter__": __iter__, "__module__": base.__module__,
                                        "__qualname__": base.__qualname__})
    _classes[base] = cls
    return cls


class FetchRng:
    """Records the RNG before each batch a sampler hands out; replays it after a restore.

    Its ``state_dict()``/``load_state_dict()`` make it an extra of a snapshot. The caller says
    how many batches of the current pass the training has consumed (:meth:`at`), because only
    the training loop knows.
    """

    def __init__(self, skip: bool = False) -> None:
        #: on resume, also skip the batches the snapshot had consumed (for a framework whose
        #: loader does not skip them itself, such as Lightning with a plain DataLoader)
        self.skip = skip
        self._states: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._start: dict[str, Any] | None = None  # the RNG when the current pass began
        self._fetched = 0  # batches handed out in the current pass
        self._consumed = 0
        self._plan: dict[str, Any] | None = None
        self.attached = False
        #: generators the sampler draws its order from (a loader's own ``torch.Generator``):
        #: their state at a pass's start is kept and replayed with the global RNG's
        self.generators: list[Any] = []
        self._gen_start: list[Any] | None = None
        self._batch_sampler: Any = None
        #: the last pass started afresh although a replay was planned: the loop had set
        #: another epoch on the sampler (read by the integrations' loader positions)
        self.moved_on = False

    def attach_loader(self, loader: Any) -> bool:
        """Hook ``loader``'s batch sampler (:meth:`attach`), and replay the generators its
        order is drawn from with the global RNG's (:func:`loader_generators`)."""
        self.generators = loader_generators(loader)
        return self.attach(getattr(loader, "batch_sampler", None))

    def attach(self, batch_sampler: Any) -> bool:
        """Hook ``batch_sampler`` (a loader's, before it is iterated). Returns False, hooking
        nothing, for a loader without one (an iterable dataset)."""
        if batch_sampler is None:
            return False
        if "_ciuic_fetch_rng" in getattr(batch_sampler, "__dict__", {}):
            batch_sampler.__dict__["_ciuic_fetch_rng"] = self
            self.attached = True
            self._batch_sampler = batch_sampler
            return True
        try:
            batch_sampler.__class__ = _hooked_class(type(batch_sampler))
        except TypeError as e:
            log.warning("cannot record the RNG at each batch of %s (%s): a resumed run's data "
                        "augmentation may differ from the uninterrupted run's",
                        type(batch_sampler).__name__, e)
            return False
        batch_sampler.__dict__["_ciuic_fetch_rng"] = self
        self.attached = True
        self._batch_sampler = batch_sampler
        return True

    def sampler_epoch(self) -> int | None:
        """The epoch the loop set on the loader's sampler (``set_epoch``), where it has one."""
        epoch = getattr(getattr(self._batch_sampler, "sampler", None), "epoch", None)
        return epoch if isinstance(epoch, int) else None

    def at(self, consumed: int) -> None:
        """The training has consumed ``consumed`` batches of the current pass (0: it is at a
        pass's end, or before the first)."""
        if consumed < 0:
            raise ValueError(f"consumed must be >= 0, got {consumed}")
        self._consumed = consumed

    # -- the sampler's side ------------------------------------------------------------------

    def iterate(self, inner: Iterator[Any]) -> Iterator[Any]:
        """Called when a pass starts (``iter(batch_sampler)``), before the loader draws its
        seed: applies a pass-start replay now, and returns the hooked pass."""
        plan, self._plan = self._plan, None
        self._fetched = 0
        self._states.clear()
        self.moved_on = False
        return self._pass(inner, self._begin(plan))

    def _begin(self, plan: dict[str, Any] | None) -> dict[str, Any] | None:
        """A pass begins under ``plan``: its pass-start part now; what the pass then follows
        (None: nothing more, or no plan)."""
        if plan is None:
            return None
        if plan["final"] is None:
            plan["final"] = rng_state()
        if plan["consumed"] == 0:
            set_rng_state(plan["final"])
            if plan["generators"] is not None:  # restored before the loader was attached
                _set_generators(self.generators, plan["generators"])
            return None
        return plan

    def _pass(self, inner: Iterator[Any], plan: dict[str, Any] | None) -> Iterator[Any]:
        if plan is None and self._plan is not None and self._fetched == 0:
            # the pass began before the restore gave its plan (Lightning sets the train loader
            # up inside configure_optimizers for a scheduler that reads
            # trainer.estimated_stepping_batches) and nothing of it is pulled yet: it follows it
            taken, self._plan = self._plan, None
            plan = self._begin(taken)
        epoch = self.sampler_epoch() if plan is not None else None
        if plan is not None and None not in (epoch, plan.get("epoch")) and epoch != plan["epoch"]:
            # the loop set another epoch on the sampler than the interrupted pass's, before
            # this first pull (its epoch from the iteration, Megatron's convention; the
            # snapshot at that pass's end): this pass is that epoch's, from its start, as the
            # uninterrupted run's next one. (Asked now, not when the pass began: a framework
            # may set the epoch between the two, as Lightning does.)
            # The global RNG is the snapshot's already (the loader drew its seed from it as
            # the pass began, as the uninterrupted run's next pass did); the generators as at
            # the snapshot (a sampler with an epoch draws its order from seed and epoch).
            self.moved_on = True
            if plan.get("generators_now") is not None:
                _set_generators(self.generators, plan["generators_now"])
            plan = None
        # first pull of the pass: a sampler that draws its order from the global RNG (a
        # RandomSampler without generator) draws it now, so the resumed pass starts from the
        # RNG the original pass started from
        if plan is not None and plan.get("start") is not None:
            set_rng_state(plan["start"])
        if plan is not None and plan.get("generators") is not None:
            _set_generators(self.generators, plan["generators"])
        self._start = rng_state()
        self._gen_start = [g.get_state() for g in self.generators]
        pending: dict[int, Any] = plan["pending"] if plan else {}
        skip = plan is not None and self.skip
        for batch in inner:
            self._fetched += 1
            j = self._fetched
            if plan is not None:
                if j <= plan["consumed"]:
                    if skip:
                        continue  # trained on before the snapshot: not fetched again
                elif j in pending:
                    set_rng_state(pending[j])
                else:
                    set_rng_state(plan["final"])
                    plan = None
            self._states[j] = rng_state()
            if len(self._states) > _KEEP:
                self._states.popitem(last=False)
            yield batch
        if plan is not None and self._fetched >= plan["consumed"]:
            set_rng_state(plan["final"])  # the pass ended on fetched-ahead batches

    # -- snapshot ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        consumed = self._consumed
        if consumed == 0:  # between passes: the generators as they are now
            return {"consumed": 0, "pending": [],
                    "generators": [g.get_state() for g in self.generators]}
        missing = [j for j in range(consumed + 1, self._fetched + 1) if j not in self._states]
        if missing:
            log.warning("%d fetched-ahead batches are older than the %d remembered: their "
                        "augmentation will differ on resume", len(missing), _KEEP)
        return {"consumed": consumed, "start": self._start, "generators": self._gen_start,
                "pending": [[j, self._states[j]] for j in range(consumed + 1, self._fetched + 1)
                            if j in self._states],
                # for a loop that then sets the next epoch itself: the sampler's epoch, and the
                # generators as that next pass finds them
                "epoch": self.sampler_epoch(),
                "generators_now": [g.get_state() for g in self.generators]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replay on the next pass. The RNG it continues with after the replayed fetches is the
        one current at :meth:`restored` (call it once the snapshot's RNG is back), else the one
        current when the pass starts."""
        if not isinstance(state, dict) or "consumed" not in state or "pending" not in state:
            raise ConfigurationError("not a FetchRng state: expected 'consumed' and 'pending'")
        self._plan = {"consumed": int(state["consumed"]), "start": state.get("start"),
                      "pending": {int(j): s for j, s in state["pending"]},
                      "final": None, "generators": None, "epoch": state.get("epoch"),
                      "generators_now": state.get("generators_now")}
        if state.get("generators") is not None:
            if self._plan["consumed"] == 0 and (self.attached or self.generators):
                _set_generators(self.generators, state["generators"])  # the next pass draws
                # from them as they were
            else:  # the interrupted pass drew its order from them as they were at its start;
                # or the loader is attached after the restore (Lightning): set when it starts
                self._plan["generators"] = state["generators"]

    def forget(self) -> None:
        """Drop a restored position: the next pass starts at its beginning, with the RNG as it
        is then."""
        self._plan = None

    def restored(self) -> None:
        """The snapshot's RNG is restored: it is the state to continue from after the replay."""
        if self._plan is not None:
            self._plan["final"] = rng_state()


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The generators ``loader`` draws its order from, each once: accelerate's synchronized
    one, its sampler's (``RandomSampler(generator=)``), its own (``DataLoader(generator=)``,
    the sampler's too with ``shuffle=True``), and the sampler's inside its batch sampler (a
    loader rebuilt around the batch sampler, as accelerate's ``prepare`` does)."""
    found = [getattr(loader, "synchronized_generator", None),
             getattr(getattr(loader, "sampler", None), "generator", None),
             getattr(loader, "generator", None)]
    inner = getattr(loader, "batch_sampler", None)
    for _ in range(4):  # a BatchSampler's sampler; accelerate's shard wraps the BatchSampler
        inner = getattr(inner, "sampler", None) or getattr(inner, "batch_sampler", None)
        found.append(getattr(inner, "generator", None))
    seen: dict[int, torch.Generator] = {}
    for g in found:
        if isinstance(g, torch.Generator):
            seen.setdefault(id(g), g)
    return list(seen.values())


def _set_generators(generators: list[Any], states: list[Any]) -> None:
    if not states and generators:
        log.warning("the snapshot holds no state of the data loader's %s (its loader had "
                    "none, or the ciuic that took it did not save them): the resumed pass "
                    "draws its order from them as they are now, not as the interrupted run had "
                    "them", counted(len(generators), "generator"))
        return
    if len(states) != len(generators):
        raise ConfigurationError(
            f"the snapshot holds the state of {counted(len(states), 'data loader generator')}, "
            f"this loader has {len(generators)}: build the loader as the snapshotted run did")
    for g, s in zip(generators, states, strict=True):
        g.set_state(s)
