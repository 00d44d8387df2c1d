"""Hugging Face transformers: a ``Trainer`` that snapshots into ciuic and resumes bit-exactly.

::

    from ciuic import SnapshotManager
    from ciuic.integrations.transformers import CiuicTrainer

    trainer = CiuicTrainer(model=model, args=args, train_dataset=ds,
                           ciuic=SnapshotManager("proj", job="run-1"))
    trainer.train()          # resumes from the job's latest snapshot when there is one

``with_ciuic(TrainerClass)`` builds the same for another ``Trainer`` subclass (TRL's trainers).

What it does, against the HF ``Trainer`` it subclasses (docs/integrations.md says why):

- It snapshots at the moments HF would save (``save_strategy``, ``save_steps``), through
  ``manager.step(..., snapshot=True)``: asynchronously, with no ``checkpoint-N`` folder. Every
  other step still calls ``step()`` (heartbeat, signals; ``snapshot=False``).
- A snapshot holds the model, the optimizer, the LR scheduler, the grad scaler, the
  ``TrainerState`` (global step, epoch, log history, the callbacks' state; through an adapter),
  the loss accumulators of the logging, the model's config (for ``ciuic restore --format hf``),
  the RNGs, and the RNG at each fetched-ahead batch (:class:`ciuic.state.replay.FetchRng`).
- ``train()`` restores all of it in one ``manager.restore()`` before the loop, the optimizer and
  scheduler being created first so that HF's ``prepare`` wraps restored objects. The data
  position is HF's: its ``global_step`` decides the batches skipped by its own
  ``skip_first_batches``; ciuic skips nothing. The RNG is ciuic's: HF's ``_load_rng_state``,
  which runs after the first resumed batch was drawn (transformers #39215), is not used;
  the RNG of each batch is set just before its fetch.
- The end of a ``train()`` that returns normally snapshots its last step (``manager.finish()``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, TypeVar

import torch
import transformers
from transformers import Trainer, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import compare_trainer_and_checkpoint_args

from ciuic.errors import ConfigurationError, StateMismatch
from ciuic.format.adapters import register_adapter
from ciuic.manager import SnapshotManager
from ciuic.state.replay import FetchRng

log = logging.getLogger("ciuic")
#: given to HF's epoch loop as the checkpoint "path" of a ciuic resume: it makes HF skip the
#: trained batches of the resumed epoch; the two methods that would read a folder are overridden
RESUMING = "ciuic://latest"
T = TypeVar("T", bound=type)

__all__ = ["RESUMING", "CiuicTrainer", "with_ciuic"]


def _state_to_tree(state: TrainerState) -> dict[str, Any]:
    return dataclasses.asdict(state)


def _state_from_tree(tree: dict[str, Any]) -> TrainerState:
    known = {f.name for f in dataclasses.fields(TrainerState)}
    dropped = sorted(set(tree) - known)
    if dropped:
        log.warning("the snapshot's TrainerState has fields this transformers does not know "
                    "(%s); they are dropped", ", ".join(dropped))
    return TrainerState(**{k: v for k, v in tree.items() if k in known})


_HOOKS = ("_init_training_state", "_prepare_for_training", "_run_epoch", "_load_rng_state",
          "_save_checkpoint", "_maybe_log_save_evaluate")
if not all(callable(getattr(Trainer, name, None)) for name in _HOOKS):  # pragma: no cover
    raise ImportError(
        "ciuic.integrations.transformers needs transformers 5 (a Trainer with "
        f"{', '.join(_HOOKS)}); this is transformers {transformers.__version__}: "
        "pip install 'ciuic[transformers]'")

register_adapter(TrainerState, "transformers.TrainerState", save=_state_to_tree,
                 load=_state_from_tree)


class _Ciuic:
    """The methods :func:`with_ciuic` puts in front of a ``Trainer`` class."""

    def __init__(self, *args: Any, ciuic: SnapshotManager | None = None, **kwargs: Any) -> None:
        if ciuic is None:
            raise ConfigurationError(
                f"{type(self).__name__} needs ciuic=SnapshotManager(PROJECT, job=JOB): the "
                "snapshot chain it trains into and resumes from")
        if not isinstance(ciuic, SnapshotManager):
            raise TypeError(f"ciuic= takes a ciuic.SnapshotManager, got {type(ciuic).__name__}")
        super().__init__(*args, **kwargs)
        self.ciuic = ciuic
        self._ciuic_fetch = FetchRng()
        self._ciuic_try_restore = False
        self._ciuic_resumed = False
        self._ciuic_loop: dict[str, Any] | None = None
        self._ciuic_due = False
        self._ciuic_deferred: int | None = None  # a due step snapshotted at its epoch's end
        self._ciuic_steps_per_epoch = 0
        self._ciuic_config: dict[str, Any] | None = None
        self._ciuic_warned_workers = False
        me: Any = self
        if me.is_deepspeed_enabled or me.is_fsdp_enabled:
            raise ConfigurationError(
                f"{type(self).__name__} does not snapshot DeepSpeed or FSDP training yet; use "
                "HF's own checkpoints for it (Trainer), or ciuic's SnapshotManager in your loop")

    # -- training ----------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any,
              **kwargs: Any) -> Any:
        """HF's ``train()``, resumed from the job's latest snapshot when it has one.

        ``resume_from_checkpoint`` (an HF folder) is for a job's first run only, to start from
        a checkpoint that HF wrote; once the job has snapshots they are what it resumes from.
        """
        me: Any = self
        if resume_from_checkpoint not in (None, False):
            latest = self.ciuic.latest()
            if latest is not None:
                raise ConfigurationError(
                    f"train(resume_from_checkpoint={resume_from_checkpoint!r}): job "
                    f"{self.ciuic.project}/{self.ciuic.job} already has snapshots (latest: "
                    f"step {latest.step}), which train() resumes from by itself. Call train() "
                    "without resume_from_checkpoint, or use another job to start over from "
                    "the HF folder.")
            self._ciuic_try_restore = False
        else:
            self._ciuic_try_restore = True
            resume_from_checkpoint = None
        self._ciuic_resumed = False
        self._ciuic_deferred = None
        out = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        latest = self.ciuic.finish()  # the last step, so that JOB@latest is the trained model
        if latest is not None and me.args.should_log:
            log.info("Training ended; job %s/%s's latest snapshot is step %d (%s)",
                     self.ciuic.project, self.ciuic.job, latest.step, latest.short_id)
        return out

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()  # type: ignore[misc]
        me: Any = self
        if not self._ciuic_fetch.attach_loader(loader):
            log.info("the train loader has no batch sampler (an iterable dataset): the RNG at "
                     "each batch fetch is not recorded, and augmentation drawn from the global "
                     "RNGs may differ on resume")
        elif me.args.dataloader_num_workers > 0 and not self._ciuic_warned_workers:
            self._ciuic_warned_workers = True
            log.warning("dataloader_num_workers=%d: augmentation drawn in worker processes is "
                        "not replayed on resume (their RNGs are the loader's); with 0 workers "
                        "it is", me.args.dataloader_num_workers)
        return loader

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int,
                             num_train_epochs: int, resume_from_checkpoint: str | None,
                             trial: Any) -> tuple[int, int]:
        me: Any = self
        epochs, steps = super()._init_training_state(  # type: ignore[misc]
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint,
            trial)
        self._ciuic_steps_per_epoch = num_update_steps_per_epoch
        if resume_from_checkpoint is not None or not self._ciuic_try_restore:
            return epochs, steps
        self._ciuic_try_restore = False
        # created now, so that one restore loads them all; HF's prepare then wraps these
        me.create_optimizer()
        me.create_scheduler(num_training_steps=max_steps, optimizer=me.optimizer)
        me._created_lr_scheduler = False  # else _prepare_for_training would build a new one
        step = self.ciuic.restore(me.model, me.optimizer, **self._ciuic_objects())
        if step is None:
            return epochs, steps
        self._ciuic_fetch.restored()  # the snapshot's RNG is back: the replay continues from it
        values = self.ciuic.restored_values
        state = values.get("trainer_state")
        if not isinstance(state, TrainerState):
            raise StateMismatch(
                f"snapshot at step {step} of {self.ciuic.project}/{self.ciuic.job} has no "
                "TrainerState: it was not written by a CiuicTrainer. Resume it with the loop "
                "that wrote it, or train into another job")
        if state.best_model_checkpoint is not None and not os.path.isdir(
                state.best_model_checkpoint):
            state.best_model_checkpoint = None
        me.state = state
        compare_trainer_and_checkpoint_args(me.args, me.state)  # type: ignore[no-untyped-call]
        me._load_callback_state()
        me.state.init_training_references(me, max_steps, num_train_epochs, trial)
        self._ciuic_loop = values.get("trainer_loop")
        self._ciuic_resumed = True
        epochs_trained = state.global_step // num_update_steps_per_epoch
        in_epoch = 0
        if not me.args.ignore_data_skip:
            in_epoch = (state.global_step % num_update_steps_per_epoch
                        * me.args.gradient_accumulation_steps)
        # "after": the snapshot holds global step N done, and the manager's "Resuming
        # training at step N+1" names the next one
        log.info("Resuming the Trainer after global step %d (epoch %d, %d batches into it)",
                 state.global_step, epochs_trained, in_epoch)
        return epochs_trained, in_epoch

    def _prepare_for_training(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._prepare_for_training(*args, **kwargs)  # type: ignore[misc]
        me: Any = self
        me._created_lr_scheduler = True  # a later train() builds its scheduler anew, as HF does
        return out

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        if self._ciuic_resumed:
            kwargs["resume_from_checkpoint"] = RESUMING  # HF skips the trained batches
            loop, self._ciuic_loop = self._ciuic_loop, None
            if loop is not None:  # HF reset these just before the first epoch
                me: Any = self
                me._tr_loss = loop["tr_loss"].to(me.args.device)
                me._total_loss_scalar = float(loop["total_loss_scalar"])
                me._globalstep_last_logged = int(loop["globalstep_last_logged"])
        return super()._run_epoch(*args, **kwargs)  # type: ignore[misc]

    def _load_rng_state(self, checkpoint: Any) -> None:
        if checkpoint == RESUMING:
            return  # restored by ciuic, at the fetch of each batch (FetchRng)
        super()._load_rng_state(checkpoint)  # type: ignore[misc]

    # -- snapshots ---------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """HF decided to save: mark the step; :meth:`_maybe_log_save_evaluate` snapshots it."""
        me: Any = self
        if me.hp_search_backend is None and trial is None:
            me.store_flos()
        for cb in [*me.callback_handler.callbacks, me.control]:
            if isinstance(cb, ExportableState):  # as HF does before writing trainer_state.json
                name = type(cb).__name__
                if isinstance(me.state.stateful_callbacks.get(name), list):
                    me.state.stateful_callbacks[name].append(cb.state())
                else:
                    me.state.stateful_callbacks[name] = cb.state()
        self._ciuic_due = True

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> Any:
        self._ciuic_due = False
        out = super()._maybe_log_save_evaluate(*args, **kwargs)  # type: ignore[misc]
        me: Any = self
        step = me.state.global_step
        in_epoch = step % max(self._ciuic_steps_per_epoch, 1)
        due = self._ciuic_due
        if self._ciuic_deferred == step:  # the epoch-end call of the deferred step below
            due, self._ciuic_deferred = True, None
        elif due and in_epoch == 0:
            # an epoch's last step, inside the epoch: snapshot at the epoch-end call that
            # follows, after the epoch's evaluation, whose RNG draws (a loader's seed, the eval
            # set's augmentation) a resume from here would not repeat
            self._ciuic_deferred, due = step, False
        self._ciuic_fetch.at(in_epoch * me.args.gradient_accumulation_steps)
        self.ciuic.step(step, me.model, me.optimizer, snapshot=due,
                        trainer_state=me.state, trainer_loop=self._ciuic_loop_state(),
                        **self._ciuic_objects(), **self._ciuic_model_config())
        return out

    def _ciuic_objects(self) -> dict[str, Any]:
        """The stateful objects besides the model and optimizer (saved and restored)."""
        me: Any = self
        objects: dict[str, Any] = {"data": self._ciuic_fetch}
        if me.lr_scheduler is not None:
            objects["lr_scheduler"] = me.lr_scheduler
        scaler = getattr(me.accelerator, "scaler", None)
        if scaler is not None:
            objects["scaler"] = scaler
        return objects

    def _ciuic_loop_state(self) -> dict[str, Any]:
        me: Any = self
        tr_loss = getattr(me, "_tr_loss", None)
        return {"tr_loss": tr_loss if isinstance(tr_loss, torch.Tensor) else torch.tensor(0.0),
                "total_loss_scalar": float(getattr(me, "_total_loss_scalar", 0.0)),
                "globalstep_last_logged": int(getattr(me, "_globalstep_last_logged", 0))}

    def _ciuic_model_config(self) -> dict[str, Any]:
        """The model's config (a plain value), for exporting a snapshot as an HF folder."""
        if self._ciuic_config is None:
            me: Any = self
            config = getattr(me.model, "config", None)
            to_json = getattr(config, "to_json_string", None)
            self._ciuic_config = {"hf_config": json.loads(to_json())} if callable(to_json) \
                else {}
        return self._ciuic_config


def with_ciuic(trainer_class: T) -> T:
    """``trainer_class`` (``Trainer`` or a subclass) with ciuic's snapshots and resume; its
    constructor takes ``ciuic=SnapshotManager(...)``."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"with_ciuic() takes a transformers.Trainer class, got {trainer_class!r}")
    if issubclass(trainer_class, _Ciuic):
        return trainer_class
    name = f"Ciuic{trainer_class.__name__}"
    return type(name, (_Ciuic, trainer_class), {"__module__": trainer_class.__module__,
                                                "__qualname__": name,
                                                "__doc__": _Ciuic.__doc__})  # type: ignore[return-value]


CiuicTrainer = with_ciuic(Trainer)
CiuicTrainer.__module__ = __name__
