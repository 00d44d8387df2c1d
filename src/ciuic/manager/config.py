"""The manager's configuration: every argument of :class:`~ciuic.manager.SnapshotManager`,
checked once, when the manager is built, and read-only after that."""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from typing import Any

from ciuic.chain.health import HealthPolicy
from ciuic.engine.compression import MODES as COMPRESSION_MODES
from ciuic.errors import ConfigurationError
from ciuic.format import layout
from ciuic.manager.interval import AutoInterval
from ciuic.store import Store

Location = str | os.PathLike[str] | Store | None


@dataclass(frozen=True)
class ManagerConfig:
    """What a manager was asked to do (see :class:`~ciuic.manager.SnapshotManager`)."""

    project: str
    job: str
    api_key: str | None = None
    encryption: bool = False
    save_interval: int | None = 1000
    time_interval_s: float | None = None
    keep_last: int | None = None
    keep_every: int | None = None
    handle_signals: bool = True
    asynchronous: bool = True
    on_busy: str = "wait"
    staging_budget_bytes: int | None = None
    store: Location = None
    mirror: str | Store | None = None
    durability: str | None = None
    compression: str = "auto"
    overlap: bool = False
    endpoint: str | None = None
    distributed: bool | None = None
    #: when a snapshot is judged unhealthy; None: no statistics and no judgment
    health: HealthPolicy | None = field(default_factory=HealthPolicy)
    #: ``save_interval="auto"`` (or ``time_interval_s="auto"``): the interval sets itself
    auto_interval: AutoInterval | None = None

    @classmethod
    def build(cls, project_id: str, job: str | None = None, **kwargs: Any) -> ManagerConfig:
        """Check every argument; raise :class:`ConfigurationError` naming the first bad one."""
        project = layout.check_name("project", project_id)
        job = layout.check_name("job", job or "default")
        auto = None
        for name in ("save_interval", "time_interval_s"):
            value = kwargs.get(name)
            if isinstance(value, str) and value != "auto":
                raise ConfigurationError(f"{name} must be a number, None or 'auto', got "
                                         f"{value!r}")
            if value == "auto" or isinstance(value, AutoInterval):
                auto = value if isinstance(value, AutoInterval) else AutoInterval()
        if auto is not None:
            if kwargs.get("time_interval_s") not in (None, "auto") and not isinstance(
                    kwargs.get("time_interval_s"), AutoInterval):
                raise ConfigurationError(
                    f"save_interval='auto' chooses the time between snapshots itself: drop "
                    f"time_interval_s={kwargs['time_interval_s']!r}, or bound the choice with "
                    "save_interval=AutoInterval(max_interval_s=...)")
            # the automatic interval is a time interval: the step trigger is off
            kwargs["save_interval"] = kwargs["time_interval_s"] = None
        kwargs["auto_interval"] = auto
        _positive("time_interval_s", kwargs.get("time_interval_s"))
        save_interval = kwargs.get("save_interval", 1000)
        if save_interval is not None and (not isinstance(save_interval, int)
                                          or isinstance(save_interval, bool) or save_interval < 0):
            raise ConfigurationError(f"save_interval must be a step count >= 0 or None, "
                                     f"got {save_interval!r}")
        kwargs["save_interval"] = save_interval or None
        for name in ("keep_last", "keep_every"):
            value = kwargs.get(name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"{name} must be an integer >= 1 or None, got {value!r}")
        endpoint = kwargs.get("endpoint") or os.environ.get("CIUIC_ENDPOINT") or None
        if endpoint is not None and kwargs.get("store") is not None:
            raise ConfigurationError("pass either store= or a server endpoint (endpoint= or "
                                     "CIUIC_ENDPOINT), not both")
        kwargs["endpoint"] = endpoint
        compression = kwargs.get("compression", "auto")
        if compression not in COMPRESSION_MODES:
            raise ConfigurationError(f"compression must be one of {COMPRESSION_MODES}, got "
                                     f"{compression!r}")
        health = kwargs.get("health", True)
        if health is True:
            health = HealthPolicy()
        elif health is False or health is None:
            health = None
        elif not isinstance(health, HealthPolicy):
            raise ConfigurationError(f"health must be True, False or a ciuic.HealthPolicy, got "
                                     f"{health!r}")
        kwargs["health"] = health
        if kwargs.get("on_busy", "wait") not in ("skip", "wait"):
            raise ConfigurationError(f"on_busy must be 'skip' or 'wait', got "
                                     f"{kwargs['on_busy']!r}")
        return cls(project=project, job=job, **kwargs)

    @property
    def retains(self) -> bool:
        """Whether snapshots are pruned after each commit (``keep_last`` / ``keep_every``)."""
        return self.keep_last is not None or self.keep_every is not None


def _positive(name: str, value: float | None) -> None:
    if value is not None and (not isinstance(value, (int, float)) or value <= 0):
        raise ConfigurationError(f"{name} must be a positive number or None, got {value!r}")


def check_step(step: Any) -> int:
    """The step number as an int: any integer-like value (``operator.index``: a NumPy integer,
    a 0-d integer tensor) that is not negative. Anything else is a programming mistake, raised
    at once."""
    if isinstance(step, bool):
        raise ConfigurationError(f"step must be a non-negative integer, got {step!r}")
    try:
        n = operator.index(step)
    except TypeError:
        raise ConfigurationError(
            f"step must be a non-negative integer (the step whose optimizer update was just "
            f"applied), got {type(step).__name__} {step!r}") from None
    if n < 0:
        raise ConfigurationError(f"step must be a non-negative integer, got {n}")
    return n


def check_state_args(call: str, model: Any, optimizer: Any) -> None:
    """Refuse a model and an optimizer passed the wrong way round (or two optimizers), which
    would otherwise be snapshotted under the wrong names and fail only at the restore."""
    import torch

    if isinstance(model, torch.optim.Optimizer):
        raise ConfigurationError(
            f"{call}(): the model argument is an optimizer ({type(model).__name__}); pass "
            "the model before the optimizer")
    if isinstance(optimizer, torch.nn.Module):
        raise ConfigurationError(
            f"{call}(): the optimizer argument is a module ({type(optimizer).__name__}); pass "
            "the model before the optimizer")
