"""DeepSpeed (ZeRO stages 0, 1, 2 and 3): the engine's whole state in the snapshot chain,
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

What a snapshot holds, against ``engine.save_checkpoint``: under ZeRO-0, -1 and -2 the module
(a global state, written once across the data-parallel ranks, as any replicated model); under
ZeRO-0 the optimizer (a global state too); under ZeRO-1 and -2 each rank's partition, as a
per-rank state: its fp32 master weights, its base optimizer's state (moments and **step
count**, which DeepSpeed's own ZeRO-1/2 checkpoints can lose, deepspeed #4396), the loss
scaler's values, the overflow and clipping settings. Under ZeRO-3 the module's parameters are
partitioned too (its ``state_dict()`` holds placeholders), so there is no global state: each
rank's per-rank state holds its fp32 master partition, the bit16 partition its parameters'
``ds_tensor`` view, the base optimizer's state (moments, step count), the loss scaler's values,
overflow and clipping, and the module's buffers (not partitioned; BatchNorm statistics are
each rank's own, as each rank updates them). Then, at every stage: the LR scheduler; the
engine's counters (global steps and samples, skipped and micro steps); each rank's RNG
(DeepSpeed saves none) and each given loader's position. All of it as plain trees and tensors:
nothing is pickled, and nothing of DeepSpeed's own classes is stored (the loss scaler's
numbers are set back on the live scaler).

A ZeRO partition belongs to one data-parallel rank of one world size: a snapshot restores onto
the ZeRO stage, world size and model that wrote it, and refuses another with the reason
(DeepSpeed's universal checkpoint conversion is the way to reshape a DeepSpeed checkpoint).
ZeRO-3 with NVMe offload (partitions in swap files) is refused when the engine is wrapped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ciuic.errors import ConfigurationError, StateMismatch
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


def _scalars(o: Any) -> dict[str, Any]:
    """A ZeRO optimizer's loss scaler (its numbers), overflow and clipping."""
    return {"loss_scaler": _plain(o.loss_scaler), "dynamic_loss_scale": bool(o.dynamic_loss_scale),
            "overflow": bool(o.overflow), "clip_grad": float(o.clip_grad)}


def _set_scalars(o: Any, state: dict[str, Any]) -> None:
    for k, v in state["loss_scaler"].items():
        if hasattr(o.loss_scaler, k):  # set back on the live scaler: none of its class stored
            setattr(o.loss_scaler, k, v)
    o.dynamic_loss_scale = bool(state["dynamic_loss_scale"])
    o.overflow = bool(state["overflow"])
    o.clip_grad = float(state["clip_grad"])


def _stage_of(layout: dict[str, Any]) -> int:
    """The ZeRO stage a partition's layout was written at (ZeRO-1/2's name no stage)."""
    return int(layout.get("stage") or (2 if layout.get("gradients_partitioned") else 1))


def _check_layout(saved: Any, want: dict[str, Any]) -> None:
    """ConfigurationError, saying what differs, unless a snapshot's partition layout is this
    engine's: a partition belongs to one data-parallel rank of one world size."""
    if saved == want:
        return
    if not isinstance(saved, dict):
        why = f"the snapshot's ZeRO state names no layout ({saved!r})"
    elif _stage_of(saved) != _stage_of(want):
        why = (f"it was written at ZeRO stage {_stage_of(saved)}, this engine runs stage "
               f"{_stage_of(want)}")
    else:
        why = "; ".join(f"{k}: snapshot {saved.get(k)}, this run {v}" for k, v in want.items()
                        if saved.get(k) != v)
    raise ConfigurationError(
        f"this ZeRO partition does not fit this engine: {why}. A ZeRO snapshot restores onto "
        "the ZeRO stage, data-parallel world size (partition_count) and model (sizes, params) "
        "that wrote it: run with those (DeepSpeed's universal checkpoint conversion is the way "
        "to reshape a DeepSpeed checkpoint)")


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
                "fp32": list(o.single_partition_of_fp32_groups)} | _scalars(o)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        o = self.optimizer
        _check_layout(state.get("layout"), self._layout())
        o.optimizer.load_state_dict(state["base"])
        with torch.no_grad():
            for live, saved in zip(o.single_partition_of_fp32_groups, state["fp32"],
                                   strict=True):
                live.copy_(saved)
        _set_scalars(o, state)


def _module_buffers(module: Any) -> dict[str, torch.Tensor]:
    """The module's persistent buffers by state-dict name (what ``state_dict()`` holds besides
    parameters): ZeRO-3 partitions parameters, never buffers."""
    out: dict[str, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        for name, buf in m._buffers.items():
            if buf is not None and name not in m._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


class Zero3Partition:
    """One rank's part of a ZeRO-3 engine (parameters partitioned): a per-rank extra of the
    snapshot. It holds what the module's ``state_dict()`` cannot (outside a forward its
    parameters are empty placeholders, or gathered copies): this rank's fp32 master partition,
    the bit16 partition its parameters' ``ds_tensor`` view, the base optimizer's state, the
    loss scaler's numbers, overflow and clipping; and the module's buffers (not partitioned:
    each rank's own, as each rank updates them)."""

    def __init__(self, engine: Any) -> None:
        o = engine.optimizer
        if not hasattr(o, "fp32_partitioned_groups_flat"):
            raise ConfigurationError(
                f"this ZeRO-3 engine has no ZeRO-3 optimizer (it has {type(o).__name__}): "
                "DeepSpeedSnapshots snapshots training; give deepspeed.initialize the optimizer")
        if getattr(o, "swap_optimizer", False) or any(
                f is None for f in o.fp16_partitioned_groups_flat):
            raise ConfigurationError(
                "this ZeRO-3 engine offloads to NVMe (offload_optimizer or offload_param device "
                "'nvme'): its partitions live in swap files, which DeepSpeedSnapshots does not "
                "read. Offload to 'cpu' or not at all, or use engine.save_checkpoint")
        self.engine = engine
        self.optimizer = o

    def _layout(self) -> dict[str, Any]:
        o = self.optimizer
        return {"stage": 3, "partition_count": int(o.partition_count),
                "sizes": [int(t.numel()) for t in o.fp32_partitioned_groups_flat],
                "params": [[int(p.ds_numel) for p in g] for g in o.fp16_groups]}

    def state_dict(self) -> dict[str, Any]:
        o = self.optimizer
        # between steps ZeRO-3 leaves the base optimizer's groups empty: the fp32 partitions
        # are put in for the call, as DeepSpeed's own state_dict does
        o._set_fp32_optimizer_param_groups()
        try:
            base = o.optimizer.state_dict()
        finally:
            o._clear_fp32_optimizer_param_groups()
        return {"layout": self._layout(), "base": base,
                "fp32": list(o.fp32_partitioned_groups_flat),
                "bit16": list(o.fp16_partitioned_groups_flat),
                "buffers": _module_buffers(self.engine.module)} | _scalars(o)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What DeepSpeed's ``load_checkpoint`` does at ZeRO-3, from the snapshot's tensors:
        every parameter partitioned first (no gathered copy goes stale), the partitions
        copied in, the persistent parameters gathered again (as after a step)."""
        o = self.optimizer
        _check_layout(state.get("layout"), self._layout())
        buffers = _module_buffers(self.engine.module)
        if sorted(state["buffers"]) != sorted(buffers):
            raise ConfigurationError(
                f"the snapshot's module buffers ({', '.join(sorted(state['buffers']))}) are "
                f"not this module's ({', '.join(sorted(buffers))}): restore onto the model "
                "that wrote it")
        o.checkpoint_event_prologue()
        o._set_fp32_optimizer_param_groups()
        try:
            o.optimizer.load_state_dict(state["base"])
        finally:
            o._clear_fp32_optimizer_param_groups()
        with torch.no_grad():
            for live, saved in zip(o.fp32_partitioned_groups_flat, state["fp32"], strict=True):
                live.copy_(saved)
            for live, saved in zip(o.fp16_partitioned_groups_flat, state["bit16"],
                                   strict=True):
                live.copy_(saved)
            for name, buf in buffers.items():
                buf.copy_(state["buffers"][name])
        for i in range(len(o.fp16_partitioned_groups_flat)):
            o._unflatten_partitioned_parameters(i)  # each param.ds_tensor a view of its flat
        _set_scalars(o, state)
        o.checkpoint_event_epilogue()


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
        self.engine = engine
        self.stage = stage
        # first: a ZeRO-3 engine it cannot snapshot is refused before the manager starts
        self.zero: ZeroPartition | Zero3Partition | None = (
            Zero3Partition(engine) if stage == 3 else ZeroPartition(engine.optimizer) if stage
            else None)
        self.manager = SnapshotManager(project_id, job=job, save_interval=save_interval,
                                       **manager_options)
        self.positions = [LoaderPosition(dl) for dl in loaders]
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
        # under ZeRO-3 the module's parameters are each rank's partition ("zero"), and its
        # state_dict() holds placeholders: no global model state
        return (None if self.stage == 3 else e.module), optimizer, extras

    def restore(self, snapshot: str | None = None) -> int:
        """Load the job's latest snapshot (or ``snapshot``) into the engine. Returns the epoch
        to start at (0 for a new job), from the first loader's position."""
        model, optimizer, extras = self._states()
        extras.pop("deepspeed")
        try:
            step = self.manager.restore(model, optimizer, snapshot=snapshot, **extras)
        except StateMismatch as e:
            raise StateMismatch(
                f"{e}\n(This engine runs ZeRO stage {self.stage}; a DeepSpeedSnapshots snapshot "
                "restores only onto the ZeRO stage that wrote it: ZeRO-3's hold each rank's "
                "parameter partition and no module state, ZeRO-0/1/2's the module as one "
                "global state. If another stage wrote this one, run with that stage.)") from e
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
