"""The Lightning callback, written once for both packages (``lightning.pytorch`` and
``pytorch_lightning``): :func:`build` makes it from the package it is given, so that Lightning's
``isinstance(callback, Callback)`` holds for the package the user trains with. Nothing here
imports Lightning; ``ciuic.integrations.lightning`` and ``.pytorch_lightning`` do.

How it hooks in (docs/integrations.md, "Lightning"):

- ``setup``: builds the :class:`SnapshotManager` from the arguments it was given (the process
  group exists by then, so under DDP every rank builds its own, as ciuic's multi-rank mode
  wants), and wraps the strategy's ``process_dataloader`` to hook the train loader's batch
  sampler (:class:`ciuic.state.replay.FetchRng`) before Lightning first iterates it; the
  generators its order is drawn from (``DataLoader(generator=)``) are kept and put back with
  the RNG's state.
- ``on_fit_start`` (optimizers exist, Lightning's own restore comes right after): one
  ``manager.restore()`` of the model, the optimizer, the data position and the RNG; the rest of
  Lightning's checkpoint (loops, callbacks, schedulers, precision plugin, datamodule) is handed
  to Lightning's checkpoint connector, which restores it as if it had read a ``.ckpt``.
- ``on_train_batch_end`` after each optimizer step: ``manager.step()``; every
  ``every_n_train_steps``-th one snapshots Lightning's own checkpoint dict
  (``dump_checkpoint``), asynchronously: the model and optimizer written once across ranks,
  Lightning's dict by rank 0 alone (as Lightning writes it; every rank reads it back), each
  rank's RNG and data position its own.
- ``on_train_end``: the last step, unless it is the latest snapshot; ``teardown`` closes.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from ciuic.errors import ConfigurationError, StateMismatch
from ciuic.manager import SnapshotManager
from ciuic.state.ddp import pin_buckets
from ciuic.state.replay import FetchRng

log = logging.getLogger("ciuic")
#: the parts of Lightning's checkpoint that ciuic stores as the model and optimizer states
_AS_STATES = ("state_dict", "optimizer_states")


def build(pl: Any) -> type:
    """The ``CiuicCallback`` class for the Lightning package ``pl``."""

    class CiuicCallback(pl.Callback):  # type: ignore[misc]
        """Snapshots a Lightning ``fit`` into a ciuic job and resumes it bit-exactly.

        ``CiuicCallback("proj", job="run-1", every_n_train_steps=50, **manager_options)``: the
        options are :class:`~ciuic.SnapshotManager`'s; the manager is built when the fit
        starts (under DDP, on every rank once the process group exists). A manager already
        built may be passed instead of the project, for single-process fits.
        """

        def __init__(self, project: str | SnapshotManager, job: str | None = None, *,
                     every_n_train_steps: int = 500, **manager_options: Any) -> None:
            if isinstance(project, SnapshotManager):
                if job is not None or manager_options:
                    raise ConfigurationError(
                        "CiuicCallback(manager) takes no job= or manager options: they are the "
                        "manager's already")
            elif not isinstance(project, str):
                raise TypeError("CiuicCallback takes a project id (str) or a SnapshotManager, "
                                f"got {type(project).__name__}")
            if (not isinstance(every_n_train_steps, int) or isinstance(every_n_train_steps, bool)
                    or every_n_train_steps < 1):
                raise ConfigurationError(
                    f"every_n_train_steps must be a positive integer, got {every_n_train_steps!r}")
            self._given = project
            self._job = job
            self._options = manager_options
            self.every_n_train_steps = every_n_train_steps
            self.manager: SnapshotManager | None = project if isinstance(
                project, SnapshotManager) else None
            self.fetch = FetchRng(skip=True)
            self._last_step: int | None = None
            self._at_epoch_end: int | None = None  # a due step deferred to the epoch's end
            self._restored = False
            self._wrapped: Any = None

        @property
        def state_key(self) -> str:
            return "CiuicCallback"

        # -- set-up --------------------------------------------------------------------------

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage != "fit":
                return
            if self.manager is None:
                assert isinstance(self._given, str)
                self.manager = SnapshotManager(self._given, job=self._job, **self._options)
            elif trainer.world_size > 1 and not self.manager.coll.enabled:
                raise ConfigurationError(
                    "CiuicCallback(manager): this fit runs on several processes, but the manager "
                    "was built before the process group existed, so each rank would act alone. "
                    "Pass the project and options instead: CiuicCallback('proj', job='run-1', "
                    "...), and the callback builds the manager on every rank")
            strategy = trainer.strategy
            if self._wrapped is None:
                original = strategy.process_dataloader
                self._wrapped = (strategy, original)

                def process_dataloader(dataloader: Any) -> Any:
                    out = original(dataloader)
                    if trainer.training:
                        self._hook(out)
                    return out

                strategy.process_dataloader = process_dataloader
            self.fetch = FetchRng(skip=True)  # this fit's loader is attached after its restore
            self._restored = False
            self._last_step = None
            self._at_epoch_end = None

        def _hook(self, loader: Any) -> None:
            stateful = callable(getattr(loader, "state_dict", None)) and callable(
                getattr(loader, "load_state_dict", None))
            self.fetch.skip = not stateful  # a stateful loader is put back by Lightning itself
            if not self.fetch.attach_loader(loader):
                log.info("the train loader has no batch sampler (an iterable dataset): the RNG "
                         "at each batch fetch is not recorded, and augmentation drawn from the "
                         "global RNGs may differ on resume")
            elif getattr(loader, "num_workers", 0) > 0:
                log.warning("num_workers=%d: augmentation drawn in worker processes is not "
                            "replayed on resume (their RNGs are the loader's); with 0 workers "
                            "it is", loader.num_workers)

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if stage != "fit":
                return
            if self._wrapped is not None:
                strategy, original = self._wrapped
                strategy.process_dataloader = original
                self._wrapped = None
            if self.manager is not None and isinstance(self._given, str):
                self.manager.close(final=False)  # the last step was taken by on_train_end
                self.manager = None

        def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
            if self.manager is not None and isinstance(self._given, str):
                self.manager.__exit__(type(exception), exception, exception.__traceback__)
                self.manager = None

        # -- restore -------------------------------------------------------------------------

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            manager = self._manager()
            optimizer = _one_optimizer(trainer)
            # the strategy's DDP wrapper (set up by now, before any forward): one bucket layout
            # for every run, so that more than 2 ranks resume bit-exactly (state/ddp.py)
            pin_buckets(trainer.strategy.model)
            if trainer.ckpt_path:
                if manager.latest() is not None:
                    raise ConfigurationError(
                        f"fit(ckpt_path={trainer.ckpt_path!r}): job {manager.project}/"
                        f"{manager.job} already has snapshots, which CiuicCallback resumes from "
                        "by itself. Drop ckpt_path, or use another job to start over from the "
                        "checkpoint file")
                return  # a first run started from a Lightning .ckpt: Lightning restores it
            step = manager.restore(pl_module, optimizer, data=self.fetch)
            if step is None:
                return
            self.fetch.restored()  # the snapshot's RNG is back: the replay continues from it
            saved = manager.restored_values.get("lightning")
            if not isinstance(saved, dict):
                raise StateMismatch(
                    f"snapshot at step {step} of {manager.project}/{manager.job} holds no "
                    "Lightning state: it was not written by CiuicCallback. Resume it with the "
                    "loop that wrote it, or train into another job")
            checkpoint = dict(saved)
            checkpoint["state_dict"] = pl_module.state_dict()  # restored in place already
            if "optimizer_states" not in checkpoint:  # restored in place too: Lightning's
                checkpoint["optimizer_states"] = [o.state_dict() for o in trainer.optimizers]
            connector = trainer._checkpoint_connector
            connector._loaded_checkpoint = checkpoint  # Lightning restores the rest from it
            connector.restore_datamodule()
            pl_module.on_load_checkpoint(checkpoint)
            connector.restore_callbacks()
            if self.fetch.skip:  # the loader skips the trained batches: Lightning's warning
                warnings.filterwarnings(  # that it cannot does not apply
                    "ignore", message="You're resuming from a checkpoint that ended before the "
                    "epoch ended and your dataloader is not resumable")
            self._restored = True
            self._last_step = step
            # "after": the snapshot holds global step N done, and the manager's "Resuming
            # training at step N+1" names the next one
            log.info("Resuming the Lightning fit after global step %d (epoch %s)", step,
                     checkpoint.get("epoch"))

        # -- snapshots -----------------------------------------------------------------------

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            step = int(trainer.global_step)
            if step == self._last_step:
                return  # accumulating gradients: no optimizer step since the last call
            self._last_step = step
            progress = trainer.fit_loop.epoch_loop.batch_progress
            manager = self._manager()
            due = step % self.every_n_train_steps == 0
            if due and progress.is_last_batch:
                # an epoch's last step: snapshot at the epoch's end, after its validation, whose
                # RNG draws (a loader's seed, the dataset's augmentation) a resume from here
                # would not repeat; Lightning resumes from there as from its own epoch-end save
                self._at_epoch_end = step
                due = False
            self.fetch.at(int(progress.current.processed))
            if due or manager.signal_pending:
                self._snapshot(trainer, pl_module, step, snapshot=due)
            else:
                manager.step(step, snapshot=False)  # heartbeat, progress, signals

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            step, self._at_epoch_end = self._at_epoch_end, None
            if step is not None and step == int(trainer.global_step):
                self.fetch.at(0)  # the next pass is not started: nothing of it is fetched yet
                self._snapshot(trainer, pl_module, step, snapshot=True)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            manager = self._manager()
            step = int(trainer.global_step)
            latest = manager.latest()
            if latest is None or latest.step != step:
                self._snapshot(trainer, pl_module, step, snapshot=True)
            manager.finish()

        def _snapshot(self, trainer: Any, pl_module: Any, step: int, snapshot: bool) -> None:
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            optimizer = _one_optimizer(trainer)
            parts: dict[str, Any] = {"data": self.fetch}  # every rank's own
            if trainer.global_rank == 0:  # Lightning's dict, as it would write it: rank 0's,
                parts["lightning"] = {  # which every rank reads back (ciuic.distributed.load)
                    k: v for k, v in checkpoint.items()
                    if k not in _AS_STATES or (k == "optimizer_states" and optimizer is None)}
            self._manager().step(step, pl_module, optimizer, snapshot=snapshot, **parts)

        def _manager(self) -> SnapshotManager:
            if self.manager is None:
                raise ConfigurationError("CiuicCallback is used outside a fit (its manager is "
                                         "built when trainer.fit() starts)")
            return self.manager

    return CiuicCallback


def _one_optimizer(trainer: Any) -> Any:
    """The fit's optimizer when it has exactly one (stored as the ``optimizer`` state, written
    once across ranks); None otherwise (several go into Lightning's dict, per rank)."""
    optimizers = list(trainer.optimizers)
    return optimizers[0] if len(optimizers) == 1 else None
