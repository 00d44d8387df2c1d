"""Hugging Face Accelerate: snapshots of everything ``accelerator.save_state`` saves and what
it misses, resumed bit-exactly, with your own training loop.

::

    from ciuic.integrations.accelerate import AccelerateSnapshots

    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    snapshots = AccelerateSnapshots(accelerator, "proj", job="run-1", save_interval=100)
    first_epoch = snapshots.restore()      # 0 for a new job; the loaders resume mid-epoch
    for epoch in range(first_epoch, num_epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                ...  # forward, accelerator.backward(loss), optimizer.step(), ...
            snapshots.step(loss=loss.item())
    snapshots.finish()                     # the final state into the chain

A snapshot holds what ``save_state`` holds (every prepared model, optimizer and scheduler, the
grad scaler, the objects given to ``register_for_checkpointing``, each process's RNGs and the
``accelerator.step`` counter) and what it does not: each prepared loader's epoch, the state of
the generator its sampler draws its order from at the start of the epoch in progress, how many
batches of that epoch were trained on, and the RNG at each batch fetched ahead
(:class:`ciuic.state.replay.FetchRng`). On resume a loader skips the batches already trained on
without loading them, in the same order, with the same augmentation.

Snapshots are taken at optimizer steps only (``accelerator.sync_gradients``): within a gradient
accumulation window the gradients are part of the state, and they are not saved.

Under FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``) the model and optimizer are
taken as ciuic takes any FSDP2 model (:mod:`ciuic.distributed.plan`): DCP's sharded state
dicts, each process writing its own shards, restored shard by shard (another world size
reshards them, as for any FSDP2 snapshot; not tested under Accelerate). FSDP1 is refused (DCP
gives its sharded state as ``ShardedTensor``s, which ciuic does not write), as are DeepSpeed,
Megatron-LM and XLA: each with what to use instead.

Under DDP, ``restore()`` pins each prepared model's gradient bucket layout before its first
forward (:mod:`ciuic.state.ddp`), so that past two processes a resumed run adds the gradients in
the uninterrupted run's order. ``prepare`` returns the DDP wrapper but keeps only the unwrapped
module in ``accelerator._models``, and holds the wrapper nowhere else: it is found among the
process's live objects, as the ``DistributedDataParallel`` whose ``module`` is the prepared one.
"""

from __future__ import annotations

import gc
import logging
from typing import Any

from ciuic.errors import ConfigurationError
from ciuic.format.info import SnapshotInfo
from ciuic.integrations._loaders import LoaderPosition
from ciuic.manager import SnapshotManager
from ciuic.state.ddp import pin_buckets

log = logging.getLogger("ciuic")

__all__ = ["AccelerateSnapshots"]


class AccelerateSnapshots:
    """Snapshots of an ``Accelerator``'s training, taken from your loop (see the module).

    Build it after ``accelerator.prepare(...)``, on every process. ``save_interval`` counts
    optimizer steps; the other arguments are :class:`~ciuic.SnapshotManager`'s (``store``,
    ``keep_last``, ``time_interval_s``, ``save_interval="auto"``, ...).
    """

    def __init__(self, accelerator: Any, project_id: str, job: str | None = None, *,
                 save_interval: Any = 1000, **manager_options: Any) -> None:
        if not hasattr(accelerator, "_models") or not hasattr(accelerator, "sync_gradients"):
            raise TypeError(f"AccelerateSnapshots takes an accelerate.Accelerator, got "
                            f"{type(accelerator).__name__}")
        if not accelerator._models:
            raise ConfigurationError(
                "AccelerateSnapshots: the accelerator has no prepared model; build it after "
                "model, optimizer, ... = accelerator.prepare(model, optimizer, ...)")
        refuse(accelerator)
        self.accelerator = accelerator
        self.manager = SnapshotManager(project_id, job=job, save_interval=save_interval,
                                       **manager_options)
        self.positions = [LoaderPosition(dl) for dl in accelerator._dataloaders]
        #: optimizer steps completed (the snapshots' step numbers)
        self.global_step = 0
        self.restored: SnapshotInfo | None = None

    def _states(self) -> tuple[Any, Any, dict[str, Any]]:
        acc = self.accelerator
        models, optimizers = list(acc._models), list(acc._optimizers)
        extras: dict[str, Any] = {f"model_{i}": m for i, m in enumerate(models[1:], 1)}
        inner = [getattr(o, "optimizer", o) for o in optimizers]
        extras |= {f"optimizer_{i}": o for i, o in enumerate(inner[1:], 1)}
        extras |= {f"scheduler_{i}": s for i, s in enumerate(acc._schedulers)}
        extras |= {f"custom_{i}": o for i, o in enumerate(acc._custom_objects)}
        extras |= {f"loader_{i}": p for i, p in enumerate(self.positions)}
        if acc.scaler is not None:
            extras["scaler"] = acc.scaler
        extras["accelerate"] = {"step": int(acc.step), "global_step": self.global_step}
        return models[0], (inner[0] if inner else None), extras

    def restore(self, snapshot: str | None = None) -> int:
        """Load the job's latest snapshot (or ``snapshot``) into everything prepared. Returns
        the epoch to start the loop at (0 for a new job); the first loader resumes within it."""
        model, optimizer, extras = self._states()
        extras.pop("accelerate")
        for wrapper in ddp_wrappers(self.accelerator):
            # before the first forward, on every process, also for a new job (state/ddp.py)
            pin_buckets(wrapper)
        step = self.manager.restore(model, optimizer, snapshot=snapshot, **extras)
        if step is None:
            return 0
        self.restored = self.manager.restored
        values = self.manager.restored_values.get("accelerate")
        if not isinstance(values, dict):
            raise ConfigurationError(
                f"snapshot at step {step} was not taken by AccelerateSnapshots (it has no "
                "accelerate counters); restore it with SnapshotManager.restore()")
        self.accelerator.step = int(values["step"])
        self.global_step = int(values["global_step"])
        for p in self.positions:
            p.fetch.restored()
        epoch = self.positions[0].epoch if self.positions else 0
        # "after": the snapshot holds global step N done, and the manager's "Resuming
        # training at step N+1" names the next one
        log.info("Resuming the Accelerate loop after global step %d (epoch %d, %d batches "
                 "into it)", self.global_step, epoch,
                 self.positions[0]._resume_at if self.positions else 0)
        return epoch

    def step(self, **metrics: Any) -> bool:
        """Call after each batch (outside ``accumulate()``). At an optimizer step it counts
        the step and snapshots when due; ``metrics`` (``loss=...``) are recorded with it.
        Returns whether a snapshot was taken."""
        if not self.accelerator.sync_gradients:
            return False  # within an accumulation window: the gradients are not saved
        self.global_step += 1
        model, optimizer, extras = self._states()
        return self.manager.step(self.global_step, model, optimizer, **extras, **metrics)

    def finish(self) -> SnapshotInfo | None:
        """The end of training: snapshot the last optimizer step unless a snapshot holds it,
        wait until it is committed, and return the job's latest snapshot."""
        return self.manager.finish()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> AccelerateSnapshots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def refuse(accelerator: Any) -> None:
    """Raise ConfigurationError for the distributed types AccelerateSnapshots does not snapshot:
    DeepSpeed, Megatron-LM and XLA (their state lives in the engine), and FSDP1 (its sharded
    state dict is made of ``ShardedTensor``s, which ciuic does not write; FSDP2 gives
    ``DTensor``s)."""
    kind = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
    if kind.upper() in ("DEEPSPEED", "MEGATRON_LM", "XLA"):
        raise ConfigurationError(
            f"AccelerateSnapshots does not snapshot {kind} training yet (its state lives in "
            "the engine); use accelerator.save_state for it")
    if kind.upper() == "FSDP" and not getattr(accelerator, "is_fsdp2", False):
        version = getattr(getattr(accelerator.state, "fsdp_plugin", None), "fsdp_version", 1)
        raise ConfigurationError(
            f"AccelerateSnapshots snapshots FSDP2 only, and this Accelerator runs FSDP{version} "
            "(FullyShardedDataParallel), whose sharded state dict is made of ShardedTensors, "
            "which ciuic does not write: set fsdp_version=2 (FullyShardedDataParallelPlugin("
            "fsdp_version=2), or fsdp_version: 2 in the accelerate config), or use "
            "accelerator.save_state for FSDP1")


def ddp_wrappers(accelerator: Any) -> list[Any]:
    """The ``DistributedDataParallel`` wrappers of the accelerator's prepared models, in the
    order of ``accelerator._models`` (the same on every process: pinning is a collective).

    ``prepare`` returns the wrapper and keeps the unwrapped module; nothing of accelerate's or
    torch's refers from the module to its wrapper, so it is looked for among the objects the
    garbage collector tracks (once, at restore). A module with no wrapper (one process, a frozen
    model) or with more than one live wrapper is skipped; a prepared model that is a
    DDP itself is taken as it is."""
    import torch

    ddp = torch.nn.parallel.DistributedDataParallel
    models = list(accelerator._models)
    if getattr(accelerator, "num_processes", 1) <= 1 or not models:
        return []
    wanted = {id(m) for m in models if not isinstance(m, ddp)}
    found: dict[int, list[Any]] = {}
    if wanted:
        for obj in gc.get_objects():
            if isinstance(obj, ddp) and id(getattr(obj, "module", None)) in wanted:
                found.setdefault(id(obj.module), []).append(obj)
    wrappers = []
    for m in models:
        if isinstance(m, ddp):
            wrappers.append(m)
        elif len(found.get(id(m), [])) == 1:
            wrappers.append(found[id(m)][0])
        elif id(m) in found:
            log.warning("%s is wrapped by %d live DistributedDataParallel objects; its gradient "
                        "bucket layout is not pinned, so with more than 2 processes a resumed run "
                        "may differ from an uninterrupted one in the last bits",
                        type(m).__name__, len(found[id(m)]))
    return wrappers
