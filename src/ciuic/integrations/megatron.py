"""megatron-core: snapshots of a model and optimizer split by tensor, pipeline and data
parallelism (the distributed optimizer included) in the ciuic chain, asynchronously, with
every rank's RNG and the data position; resumed bit-exactly, and onto another parallel layout
where Megatron's sharded metadata allows it.

::

    from ciuic.integrations.megatron import MegatronSnapshots

    model = DistributedDataParallel(config, ddp_config, GPTModel(...))
    optimizer = get_megatron_optimizer(opt_config, [model])
    scheduler = OptimizerParamScheduler(optimizer, ...)
    snapshots = MegatronSnapshots(model, optimizer, "gpt", job="run-1", scheduler=scheduler,
                                  save_interval=100, loaders=[loader])
    iteration = snapshots.restore()            # 0 for a new job; the loader resumes mid-epoch
    while iteration < train_iters:
        forward_backward_func(...)
        optimizer.step()
        scheduler.step(increment=global_batch_size)
        iteration += 1
        snapshots.step(iteration, loss=loss)
    snapshots.finish()

What a snapshot holds: each rank's part of megatron-core's ``sharded_state_dict()`` of the
model chunks and of the optimizer (``optimizer.sharded_state_dict(model_state)``; the
distributed optimizer with ``dp_reshardable`` sharding, its fp32 master weights and moments
sharded across the data-parallel ranks), every box of a global tensor written once across the
job (by its main replica); the optimizer's and the model's ``ShardedObject`` values as plain
trees through ciuic's adapters (no pickle on the load path); the common state; the iteration;
the ``OptimizerParamScheduler``; each rank's RNG (Python, NumPy, torch, CUDA and Megatron's
CUDA RNG tracker states: the tensor-parallel and expert streams) and each given loader's
position. Snapshots are ciuic's: incremental, asynchronous (the step waits for the copy only),
committed by every rank or none (the two-phase commit).

Restore, by what changed since the snapshot (:mod:`ciuic.integrations.megatron_shards`):

- the same layout (world size and TP/PP/DP sizes): everything, bit-exactly;
- another layout: the model, and a non-distributed optimizer's state, are resharded exactly to
  any TP, PP and DP whose boxes the saved boxes cover (Megatron's sharded metadata, as its own
  ``dist_checkpointing`` reshards them); the distributed optimizer's ``dp_reshardable`` state is
  kept per TPxPP bucket (one global tensor per bucket, laid out independently of the DP size),
  so it reshards exactly to another DP size only (Megatron's own limit for that format). The
  iteration, scheduler and common state come over; the RNG tracker's states are not set (they
  are per TP rank) and each rank's RNG and loader position are those of saved rank ``r % N``
  (logged by the manager). After a DP change a saved loader position is another split's: the
  loaders start their next pass at its beginning and ``data_resumed`` is False, so position
  the data by the consumed samples (the scheduler's ``num_steps`` when stepped by the global
  batch size), as Megatron-LM's samplers do.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ciuic.chain.read import read_body
from ciuic.errors import ConfigurationError, StateMismatch
from ciuic.format.info import SnapshotInfo
from ciuic.integrations._loaders import LoaderPosition
from ciuic.integrations.megatron_shards import SavedPieces, from_snapshot, to_snapshot
from ciuic.manager import SnapshotManager
from ciuic.restore.reader import load_trees

try:
    from megatron.core import parallel_state, tensor_parallel
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("ciuic.integrations.megatron needs megatron-core: pip install "
                      "'ciuic[megatron]'") from e

log = logging.getLogger("ciuic")

__all__ = ["MegatronSnapshots"]

STATE = "megatron"  # the snapshot extra's name
FORMAT = 1


def _unwrap(chunk: Any) -> Any:
    """The innermost module that has ``sharded_state_dict`` (inside Megatron's DDP and Float16
    wrappers, whose own state dicts prefix every name with ``module.``)."""
    while hasattr(getattr(chunk, "module", None), "sharded_state_dict"):
        chunk = chunk.module
    if not hasattr(chunk, "sharded_state_dict"):
        raise TypeError(f"MegatronSnapshots takes megatron-core model chunks (a MegatronModule, "
                        f"or Megatron's DDP around one), got {type(chunk).__name__}")
    return chunk


def layout() -> dict[str, int]:
    """This rank's place in the parallel layout."""
    ps = parallel_state
    return {"tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank()}


def _tracker_states() -> dict[str, Any]:
    """Megatron's CUDA RNG tracker states (empty where it keeps none: the inference tracker)."""
    return dict(tensor_parallel.get_cuda_rng_tracker().get_states())


class MegatronState:
    """This rank's Megatron state as a snapshot extra: its part of the sharded state dict, the
    iteration, the layout and the RNG tracker's states. ``load_state_dict`` only keeps the saved
    value; :meth:`MegatronSnapshots.restore` loads it once every rank has read its own."""

    def __init__(self, owner: MegatronSnapshots) -> None:
        self.owner = owner
        self.saved: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        o = self.owner
        return {"format": FORMAT, "iteration": o.iteration, "layout": layout(),
                "sharding_type": o.sharding_type, "tracker": _tracker_states(),
                **to_snapshot(o.sharded_state_dict(is_loading=False))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise StateMismatch("the snapshot's Megatron state is not of a format this ciuic "
                                "reads (it was not taken by MegatronSnapshots, or by a newer "
                                "ciuic)")
        self.saved = state


class MegatronSnapshots:
    """Snapshots of a megatron-core training loop (see the module).

    Build it on every rank after the model, optimizer and scheduler. ``model``: the model
    chunk, or the list of chunks (virtual pipeline stages), as given to the optimizer.
    ``scheduler``: the ``OptimizerParamScheduler``. ``loaders``: data loaders whose position
    to keep. ``sharding_type``: the distributed optimizer's sharded state format
    (``dp_reshardable``, the one without flattened ranges). ``save_interval`` counts
    iterations; the other arguments are :class:`~ciuic.SnapshotManager`'s.
    """

    def __init__(self, model: Any, optimizer: Any, project_id: str, job: str | None = None, *,
                 scheduler: Any = None, loaders: list[Any] | tuple[Any, ...] = (),
                 save_interval: Any = 1000, sharding_type: str = "dp_reshardable",
                 **manager_options: Any) -> None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.chunks = [_unwrap(c) for c in chunks]
        if optimizer is not None and not hasattr(optimizer, "sharded_state_dict"):
            raise TypeError(f"MegatronSnapshots takes a megatron-core optimizer "
                            f"(get_megatron_optimizer's), got {type(optimizer).__name__}")
        if sharding_type != "dp_reshardable":
            raise ConfigurationError(
                f"sharding_type={sharding_type!r}: MegatronSnapshots stores the distributed "
                "optimizer as 'dp_reshardable' (boxes of each bucket; the other formats cut "
                "tensors into flattened ranges or gather them on one rank)")
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sharding_type = sharding_type
        self.iteration = 0
        self.state = MegatronState(self)
        self.positions = [LoaderPosition(dl) for dl in loaders]
        self.manager = SnapshotManager(project_id, job=job, save_interval=save_interval,
                                       **manager_options)
        self.restored: SnapshotInfo | None = None
        #: whether restore() put the loaders back where the snapshot's were: False for a new
        #: job, without loaders, and after a data-parallel size change (the loop then positions
        #: the data by the consumed samples, as Megatron-LM does)
        self.data_resumed = False

    # -- the state -------------------------------------------------------------------------

    def sharded_state_dict(self, *, is_loading: bool) -> dict[str, Any]:
        """The job's sharded state dict on this rank, as Megatron-LM builds it for its own
        checkpoints: ``model`` (or ``model0``, ``model1``, ... for virtual pipeline stages)
        and ``optimizer``."""
        metadata = {"distrib_optim_sharding_type": self.sharding_type,
                    "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
        state: dict[str, Any] = {}
        model: dict[str, Any] = {}
        for i, chunk in enumerate(self.chunks):
            sd = chunk.sharded_state_dict(metadata=metadata)
            state["model" if len(self.chunks) == 1 else f"model{i}"] = sd
            model.update(sd)
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model, is_loading=is_loading, metadata=metadata)
        return state

    def _extras(self) -> dict[str, Any]:
        extras: dict[str, Any] = {STATE: self.state}
        if self.scheduler is not None:
            extras["scheduler"] = self.scheduler
        extras |= {f"loader_{i}": p for i, p in enumerate(self.positions)}
        return extras

    # -- the loop --------------------------------------------------------------------------

    def restore(self, snapshot: str | None = None) -> int:
        """Load the job's latest snapshot (or ``snapshot``) into the model, optimizer, scheduler
        and loaders, on every rank. Returns the iteration it holds (0 for a new job): the
        loop continues with the next one."""
        self.state.saved = None
        self.data_resumed = False
        step = self.manager.restore(snapshot=snapshot, **self._extras())
        if step is None:
            return 0
        info = self.restored = self.manager.restored
        assert info is not None and self.state.saved is not None
        error: str | None = None
        try:
            same = self._load(info, self.state.saved)
        except Exception as e:  # every rank stops: none trains on a half-loaded state
            log.error("loading the Megatron state failed on this rank", exc_info=True)
            error = f"{type(e).__name__}: {e}"
        self.manager.coll.agree("loading the Megatron state", error)
        self.iteration = int(self.state.saved["iteration"])
        log.info("Resuming the Megatron loop after global step %d (iteration %d%s)",
                 self.iteration, self.iteration, "" if same else
                 ", resharded from " + _describe(self.state.saved["layout"]))
        self.state.saved = None
        return self.iteration

    def _load(self, info: SnapshotInfo, saved: dict[str, Any]) -> bool:
        """Load the saved state into the live objects; whether the layout was the same."""
        _, trees = read_body(self.manager.repo, info)
        # a multi-rank body lists every rank's part; a single process's (one GPU) is its part
        parts = trees.get("ranks", [trees])
        here = layout()
        same = len(parts) == self.manager.coll.world_size and saved["layout"] == here
        if saved.get("sharding_type") != self.sharding_type:
            raise StateMismatch(f"the snapshot's distributed optimizer state is "
                                f"{saved.get('sharding_type')!r}, this run asks for "
                                f"{self.sharding_type!r}")
        # the common state: this rank's own on the same layout, else rank 0's (as Megatron's
        # own dist_checkpointing loads it)
        common = saved["common"] if same else load_trees(
            self.manager.repo, {"c": parts[0][STATE]["common"]})["c"]
        pieces = SavedPieces.of(self.manager.repo, parts, STATE)
        _fresh_state(self.optimizer)
        state = from_snapshot(self.sharded_state_dict(is_loading=True), saved, pieces, common)
        with torch.no_grad():  # the distributed optimizer copies into views of parameters
            for i, chunk in enumerate(self.chunks):
                chunk.load_state_dict(state["model" if len(self.chunks) == 1 else f"model{i}"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(state["optimizer"])
                _own_step_counts(self.optimizer)
        self.data_resumed = bool(self.positions) and saved["layout"]["dp"] == here["dp"]
        if self.positions and not self.data_resumed:
            for position in self.positions:  # another split's: it would skip wrong batches
                position.start_over()
            if self.manager.coll.rank == 0:
                log.warning("the data-parallel size changed (%d -> %d): the loaders' saved "
                            "positions are of samplers that split the data %d ways, so they "
                            "start their next pass at its beginning; position the data by the "
                            "consumed samples (data_resumed is False)",
                            saved["layout"]["dp"], here["dp"], saved["layout"]["dp"])
        if same and saved["tracker"]:
            tensor_parallel.get_cuda_rng_tracker().set_states(saved["tracker"])
        elif saved["tracker"] and here["tp_rank"] == 0 and here["pp_rank"] == 0:
            log.warning("Megatron's CUDA RNG tracker states are per parallel rank: after a "
                        "layout change they start from the seed of this run")
        return same

    def step(self, iteration: int, *, snapshot: bool | None = None, **metrics: Any) -> bool:
        """Call after each iteration (optimizer and scheduler stepped) with the number of
        iterations done; snapshots when due (``snapshot=True``: now; ``False``: not now).
        ``metrics`` are recorded with it."""
        self.iteration = int(iteration)
        return self.manager.step(self.iteration, snapshot=snapshot, **self._extras(),
                                 **metrics)

    def finish(self) -> SnapshotInfo | None:
        """The end of training: snapshot the last iteration unless a snapshot holds it, wait
        until it is committed, and return the job's latest snapshot."""
        return self.manager.finish()

    def close(self) -> None:
        self.manager.close()

    def __enter__(self) -> MegatronSnapshots:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fresh_state(optimizer: Any) -> None:
    """Give a distributed optimizer that has not stepped yet its state, so that its
    ``state_dict()`` (which every sharded state dict starts from) works: without Apex or
    Transformer Engine, megatron-core reads the step count from each parameter's state of the
    inner torch optimizer, and asserts there is one. Its own ``init_state_fn`` creates the
    moments; the step count is set to 0. The load replaces all of it."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if (type(o).__name__ != "DistributedOptimizer" or inner is None or inner.state
                or getattr(o, "init_state_fn", None) is None):
            continue
        o.init_state_fn(inner, o.config)
        for state in inner.state.values():
            state.setdefault("step", torch.tensor(0.0))


def _own_step_counts(optimizer: Any) -> None:
    """After a distributed optimizer's ``load_state_dict``: each parameter's step count from
    its group's, in a tensor of its own. Without Apex or Transformer Engine, megatron-core
    0.16 keeps the counts it found in the (fresh) state, 0, and where it sets them, it sets
    one tensor for every parameter, which the torch optimizer then advances once per
    parameter at each step (Adam's bias correction goes wrong either way)."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        if type(o).__name__ != "DistributedOptimizer" or inner is None:
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = inner.state.get(p)
                if state and isinstance(state.get("step"), torch.Tensor):
                    state["step"] = torch.tensor(float(group["step"]),
                                                 dtype=state["step"].dtype,
                                                 device=state["step"].device)


def _describe(saved: dict[str, Any]) -> str:
    return "TP{tp} PP{pp} DP{dp}".format(**saved)
