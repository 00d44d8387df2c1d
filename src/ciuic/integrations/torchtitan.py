"""torchtitan: a checkpoint manager its config selects, so that a torchtitan job snapshots into
the ciuic chain (asynchronously, every rank's RNG included) and resumes bit-exactly.

torchtitan builds its checkpointer from ``Trainer.Config.checkpoint``, whose type is
``BaseCheckpointManager.Config``; this module's :class:`CiuicCheckpointManager` is such a
manager. Select it in the job's config::

    from ciuic.integrations.torchtitan import CiuicCheckpointManager

    config = Trainer.Config(
        ...,
        checkpoint=CiuicCheckpointManager.Config(enable=True, interval=500, keep_latest_k=5,
                                                 project="llama3", job="8b-run-1"),
    )

Everything torchtitan's own manager saves goes into a snapshot: the model (through DCP's state
dict, so an FSDP2 model's shards are written once, by the rank that holds them, and reshard on a
restore at another world size), the optimizer (the same), the LR schedulers, the data loader's
state and every entry of ``states`` (the trainer's ``train_state``: step, tokens seen). What it
does not save, a snapshot has too: each rank's RNG (Python, NumPy, torch, CUDA), so that dropout
and random augmentation continue as if never interrupted.

The data loader's state is stored as its plain state dict: the pickled bytes torchtitan's own
``ParallelAwareDataloader.state_dict`` makes are not (nothing on a ciuic load path unpickles).

Config fields, besides torchtitan's (``enable``, ``folder``, ``interval``, ``keep_latest_k``,
``load_step``, ``exclude_from_loading``, ``initial_load_path``, ``load_only``,
``enable_first_step_checkpoint``): ``project`` and ``job`` (the chain's names), ``store`` (a
path or URL; default: the dump folder's checkpoint ``folder``, as torchtitan's own),
``time_interval_s``, ``encryption``, ``compression``, ``asynchronous``.

Not supported, each refused with the reason at start-up: more than one model part (pipeline
parallelism) or more than one optimizer per part (use torchtitan's DCP manager for those), and
``last_save_in_hf`` (the final snapshot holds the whole state; ``ciuic restore JOB@latest
--to model.safetensors`` writes its weights).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ciuic.errors import ConfigurationError
from ciuic.integrations._loaders import with_iter
from ciuic.manager import SnapshotManager
from ciuic.words import counted

try:
    from torchtitan.components.checkpointer import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
    )
    from torchtitan.tools import filesystem
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("ciuic.integrations.torchtitan needs torchtitan: pip install "
                      "'ciuic[torchtitan]'") from e

log = logging.getLogger("ciuic")

__all__ = ["CiuicCheckpointManager", "LoaderState"]


_quiet_classes: dict[type, type] = {}


def _quiet_iter(base: type) -> Callable[[Any], Iterator[Any]]:
    """A first pass after a restore that leaves the RNGs (torch's, and the loader's own
    generator) as the restore set them."""

    def __iter__(self: Any) -> Iterator[Any]:
        if not self.__dict__.pop("_ciuic_restored", False):
            return base.__iter__(self)  # type: ignore[attr-defined, no-any-return]
        generator = getattr(self, "generator", None)
        if not isinstance(generator, torch.Generator):
            generator = None
        own = generator.get_state() if generator is not None else None
        cpu = torch.get_rng_state()
        try:
            return base.__iter__(self)  # type: ignore[attr-defined, no-any-return]
        finally:
            torch.set_rng_state(cpu)
            if generator is not None and own is not None:
                generator.set_state(own)

    return __iter__


class LoaderState:
    """A torchdata ``StatefulDataLoader``'s state as a plain tree, not the pickled bytes
    torchtitan's ``ParallelAwareDataloader`` wraps it in; checked against the data-parallel
    world size it was saved at.

    A loader draws a seed from torch's RNG each time a pass starts (``iter(loader)``). The
    uninterrupted run drew it once, before the snapshot's RNG state was taken; a resumed run
    starts a pass again after the restore, and that draw would shift every random number
    after it (dropout, augmentation). So the first pass after a restore leaves the RNGs as the
    snapshot had them."""

    def __init__(self, loader: Any) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        if not isinstance(loader, StatefulDataLoader):
            raise ConfigurationError(
                f"CiuicCheckpointManager: the dataloader is a {type(loader).__name__}; it "
                "must be a torchdata StatefulDataLoader (torchtitan's ParallelAwareDataloader "
                "is one)")
        self.loader = loader
        self._base = StatefulDataLoader
        if type(loader) not in _quiet_classes.values():
            loader.__class__ = with_iter(type(loader), _quiet_classes, _quiet_iter)

    def state_dict(self) -> dict[str, Any]:
        return {"world_size": int(getattr(self.loader, "dp_world_size", 1)),
                "state": self._base.state_dict(self.loader)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        world = int(getattr(self.loader, "dp_world_size", 1))
        if int(state["world_size"]) != world:
            raise ConfigurationError(
                "the snapshot's data loader state is of "
                f"{counted(int(state['world_size']), 'data-parallel rank')}, this job has "
                f"{world}: torchtitan's loaders do not reshard their "
                "position; resume at the same data-parallel degree, or leave the loader out "
                "with exclude_from_loading=['dataloader']")
        self._base.load_state_dict(self.loader, state["state"])
        self.loader.__dict__["_ciuic_restored"] = True


class CiuicCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """torchtitan's checkpoint manager contract, backed by a ciuic snapshot chain (see the
    module)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        project: str = "torchtitan"
        """The ciuic project the snapshots belong to."""

        job: str = "train"
        """The job (one chain) within the project; a rerun of the same job resumes it."""

        store: str | None = None
        """Where the snapshots go: a path or a store URL (s3://...). Default: the dump
        folder's checkpoint ``folder``."""

        time_interval_s: float | None = None
        """Also snapshot when this many seconds passed since the last one."""

        encryption: bool = False
        """Seal every object with AES-256-GCM (the key from CIUIC_ENCRYPTION_KEY)."""

        compression: str = "auto"
        """Lossless float compression: "auto", "on" or "off"."""

        asynchronous: bool = True
        """Write snapshots in the background (the step waits only for the copy)."""

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future = None
        if len(model_parts) != 1:
            raise ConfigurationError(
                f"CiuicCheckpointManager: {len(model_parts)} model parts (pipeline "
                "parallelism) are not supported yet; use torchtitan's CheckpointManager")
        inner = list(getattr(optimizers, "optimizers", [optimizers]))
        if len(inner) != 1:
            raise ConfigurationError(
                f"CiuicCheckpointManager: the optimizer container holds {len(inner)} "
                "optimizers (mixed optimizer types); one is supported yet, use torchtitan's "
                "CheckpointManager for more")
        if config.last_save_in_hf:
            raise ConfigurationError(
                "CiuicCheckpointManager: last_save_in_hf is not supported (the final snapshot "
                "holds the whole state); write its weights with `ciuic restore JOB@latest "
                "--to model.safetensors`")
        if config.initial_load_in_hf:
            raise ConfigurationError(
                "CiuicCheckpointManager: initial_load_in_hf is not supported; convert the "
                "weights to a DCP checkpoint and give its path as initial_load_path")
        self.config = config
        self.model = model_parts[0]
        self.optimizer = inner[0]
        self.extras: dict[str, Any] = {LR_SCHEDULER: lr_schedulers, **states}
        if dataloader is not None:
            self.extras[DATALOADER] = LoaderState(dataloader)
        for name in (MODEL, OPTIMIZER):
            if name in states:
                raise ConfigurationError(f"CiuicCheckpointManager: states has {name!r}, a "
                                         "name the manager gives the model or optimizer")
        unknown = set(config.exclude_from_loading) - {OPTIMIZER, *self.extras}
        if unknown:
            raise ConfigurationError(
                f"checkpoint.exclude_from_loading names {sorted(unknown)}, which this job does "
                f"not save; the names are: {sorted({OPTIMIZER, *self.extras})}")
        store = config.store or filesystem.join(base_folder, config.folder)
        self.manager = SnapshotManager(
            config.project, job=config.job, store=store, save_interval=None,
            time_interval_s=config.time_interval_s,
            keep_last=config.keep_latest_k or None, encryption=config.encryption,
            compression=config.compression, asynchronous=config.asynchronous)

    def _load(self, step: int = -1) -> bool:
        excluded = set(self.config.exclude_from_loading)
        extras = {k: v for k, v in self.extras.items() if k not in excluded}
        optimizer = None if OPTIMIZER in excluded else self.optimizer
        snapshot = None if step == -1 else f"{self.config.job}@{step}"
        restored = self.manager.restore(self.model, optimizer, snapshot=snapshot, **extras)
        if restored is not None:
            return True
        if self.config.initial_load_path:
            self._initial_load(self.config.initial_load_path)
            return True
        return False

    def _initial_load(self, path: str) -> None:
        """A job's first start from a torchtitan (DCP) checkpoint: its model only."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        from ciuic.distributed.plan import model_state_dict

        if not self.config.initial_load_model_only:
            raise ConfigurationError(
                "CiuicCheckpointManager loads the model only from initial_load_path (its "
                "optimizer and data state are torchtitan's DCP layout); set "
                "initial_load_model_only=True")
        state = model_state_dict(self.model)  # with the model's own hooks (fused QKV)
        load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state)
        log.info("Loaded the model from %s (the job's first start)", path)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.config.load_only:
            return False
        first = self.config.enable_first_step_checkpoint and curr_step == 1
        due = last_step or first or curr_step % self.config.interval == 0
        # not due: None lets time_interval_s decide
        took = self.manager.step(curr_step, self.model, self.optimizer,
                                 snapshot=True if due else None, **self.extras)
        if last_step:
            self.manager.finish()
        return took

    def _wait_for_saving(self) -> None:
        self.manager.wait()

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: a snapshot's state is staged before ``save`` returns."""

    def _close(self) -> None:
        if hasattr(self, "manager"):
            self.manager.close()
