"""DeepSpeed (ZeRO stages 0, 1 and 2): the engine's whole state in the snapshot chain,
asynchronously, with each rank's RNG and data position; resumed bit-exactly.

::

    from ciuic.integrations.deepspeed import DeepSpeedSnapshots

    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=opt,
                                                           lr_scheduler=sched, config=cfg)
    snapshots = DeepSpeedSnapshots(engine, "proj", job="run-1", save_interval=100,
                                   loaders=[loader])
    first_epoch = snapshots.restore()      # 0 for a new job; the loader resumes mid-epoch
    for epoch in range(first_epoch, num_epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = ...
            engine.backward(loss)
            engine.step()
            snapshots.step(loss=loss.item())
    snapshots.finish()

What a snapshot holds, against ``engine.save_checkpoint``: the module (a global state, written
once across the data-parallel ranks, as any replicated model); under ZeRO-0 the optimizer (a
global state too); under ZeRO-1 and -2 each rank's partition, as a per-rank state: its fp32
master weights, its base optimizer's state (moments and **step count**, which DeepSpeed's own
ZeRO-1/2 checkpoints can lose, deepspeed #4396), the loss scaler's values, the overflow and
clipping settings; the LR scheduler; the engine's counters (global steps and samples, skipped
and micro steps); each rank's RNG (DeepSpeed saves none) and each given loader's position. All
of it as plain trees and tensors: nothing is pickled, and nothing of DeepSpeed's own classes is
stored (the loss scaler's numbers are set back on the live scaler).

A ZeRO partition belongs to one data-parallel rank of one world size: a snapshot restores onto
the world size that wrote it, and refuses another with the reason (DeepSpeed's universal
checkpoint conversion is the way to change it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ciuic.errors import ConfigurationError
from ciuic.format.info import SnapshotInfo
from ciuic.integrations._loaders import LoaderPosition
from ciuic.manager import SnapshotManager

log = logging.getLogger("ciuic")
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")

__all__ = ["DeepSpeedSnapshots"]


def _plain(obj: Any) -> dict[str, Any]:
    """The plain-valued attributes of a DeepSpeed object (a loss scaler)."""
    return {k: v for k, v in vars(obj).items()
            if isinstance(v, (bool, int, float, str)) or v is None}


class ZeroPartition:
    """One rank's part of a ZeRO-1/2 optimizer: a per-rank extra of the snapshot."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def _layout(self) -> dict[str, Any]:
        o = self.optimizer
        return {"partition_count": [int(c) for c in o.partition_count],
                "sizes": [int(t.numel()) for t in o.single_partition_of_fp32_groups],
                "gradients_partitioned": bool(getattr(o, "partition_gradients", False))}

    def state_dict(self) -> dict[str, Any]:
        o = self.optimizer
        return {"layout": self._layout(), "base": o.optimizer.state_dict(),
                "fp32": list(o.single_partition_of_fp32_groups),
                "loss_scaler": _plain(o.loss_scaler),
                "dynamic_loss_scale": bool(o.dynamic_loss_scale), "overflow": bool(o.overflow),
                "clip_grad": float(o.clip_grad)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        o = self.optimizer
        want = self._layout()
        if state.get("layout") != want:
            raise ConfigurationError(
                f"this ZeRO partition was written by another layout ({state.get('layout')}; "
                f"this run: {want}): a ZeRO-1/2 snapshot restores onto the world size and "
                "ZeRO stage that wrote it. Run with those, or convert with DeepSpeed's "
                "universal checkpoint tools")
        o.optimizer.load_state_dict(state["base"])
        with torch.no_grad():
            for live, saved in zip(o.single_partition_of_fp32_groups, state["fp32"],
                                   strict=True):
                live.copy_(saved)
        for k, v in state["loss_scaler"].items():
            if hasattr(o.loss_scaler, k):
                setattr(o.loss_scaler, k, v)
        o.dynamic_loss_scale = bool(state["dynamic_loss_scale"])
        o.overflow = bool(state["overflow"])
        o.clip_grad = float(state["clip_grad"])


class DeepSpeedSnapshots:
    """Snapshots of a DeepSpeed engine's training, from your loop (see the module).

    Build it after ``deepspeed.initialize``, on every rank. ``save_interval`` counts optimizer
    steps (``engine.global_steps``). ``loaders``: the data loaders whose position to keep (the
    loader resumes mid-epoch by itself, skipping what was trained). The other arguments are
    :class:`~ciuic.SnapshotManager`'s.
    """

    def __init__(self, engine: Any, project_id: str, job: str | None = None, *,
                 save_interval: Any = 1000, loaders: list[Any] | tuple[Any, ...] = (),
                 **manager_options: Any) -> None:
        if not all(hasattr(engine, a) for a in ("module", "optimizer", "global_steps")):
            raise TypeError(f"DeepSpeedSnapshots takes a DeepSpeed engine (deepspeed.initialize"
                            f"'s first value), got {type(engine).__name__}")
        stage = int(engine.zero_optimization_stage())
        if stage > 2:
            raise ConfigurationError(
                f"DeepSpeedSnapshots supports ZeRO stages 0, 1 and 2; this engine runs stage "
                f"{stage} (parameters partitioned): use engine.save_checkpoint for it")
        self.engine = engine
        self.stage = stage
        self.manager = SnapshotManager(project_id, job=job, save_interval=save_interval,
                                       **manager_options)
        self.positions = [LoaderPosition(dl) for dl in loaders]
        self.zero = ZeroPartition(engine.optimizer) if stage else None
        self._steps_seen = int(engine.global_steps)
        self.restored: SnapshotInfo | None = None

    def _states(self) -> tuple[Any, Any, dict[str, Any]]:
        e = self.engine
        extras: dict[str, Any] = {f"loader_{i}": p for i, p in enumerate(self.positions)}
        optimizer = None
        if self.zero is not None:
            extras["zero"] = self.zero
        elif e.optimizer is not None:
            optimizer = e.optimizer
        if e.lr_scheduler is not None:
            extras["lr_scheduler"] = e.lr_scheduler
        extras["deepspeed"] = {k: int(getattr(e, k)) for k in _COUNTERS} | {
            "zero_stage": self.stage}
        return e.module, optimizer, extras

    def restore(self, snapshot: str | None = None) -> int:
        """Load the job's latest snapshot (or ``snapshot``) into the engine. Returns the epoch
        to start at (0 for a new job), from the first loader's position."""
        model, optimizer, extras = self._states()
        extras.pop("deepspeed")
        step = self.manager.restore(model, optimizer, snapshot=snapshot, **extras)
        if step is None:
            return 0
        self.restored = self.manager.restored
        values = self.manager.restored_values.get("deepspeed")
        if not isinstance(values, dict) or values.get("zero_stage") != self.stage:
            raise ConfigurationError(
                f"snapshot at step {step} was not taken by DeepSpeedSnapshots at ZeRO stage "
                f"{self.stage} (it holds {values!r}); restore it with the stage that wrote it")
        for k in _COUNTERS:
            setattr(self.engine, k, int(values[k]))
        self._steps_seen = int(self.engine.global_steps)
        for p in self.positions:
            p.fetch.restored()
        epoch = self.positions[0].epoch if self.positions else 0
        # "after": the snapshot holds global step N done, and the manager's "Resuming
        # training at step N+1" names the next one
        log.info("Resuming the DeepSpeed loop after global step %d (epoch %d, %d batches "
                 "into it)", self.engine.global_steps, epoch,
                 self.positions[0]._resume_at if self.positions else 0)
        return epoch

    def step(self, **metrics: Any) -> bool:
        """Call after each ``engine.step()``. At an optimizer step (the end of a gradient
        accumulation window) it snapshots when due; ``metrics`` are recorded with it."""
        steps = int(self.engine.global_steps)
        if steps == self._steps_seen:
            return False  # within an accumulation window: the gradients are not saved
        self._steps_seen = steps
        model, optimizer, extras = self._states()
        return self.manager.step(steps, model, optimizer, **extras, **metrics)

    def finish(self) -> SnapshotInfo | None:
        """The end of training: snapshot the last optimizer step unless a snapshot holds it,
        wait until it is committed, and return the job's latest snapshot."""
        return self.manager.finish()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> DeepSpeedSnapshots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
