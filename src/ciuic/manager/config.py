"""The manager's options, declared once: :class:`ManagerOptions` is every argument of
:class:`~ciuic.manager.SnapshotManager` (name, type, default, documentation), and
:class:`ManagerConfig` the same options checked, once, when the manager is built, and read-only
after that.

``SnapshotManager.__init__`` spells its signature out (``tests/test_manager.py`` checks that it
is ``ManagerOptions``' own, parameter for parameter), and its docstring's argument list is built
from the documentation here (:func:`options_doc`).
"""

from __future__ import annotations

import operator
import os
import textwrap
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import Any, TypeVar

from ciuic.chain.health import HealthPolicy
from ciuic.engine.compression import MODES as COMPRESSION_MODES
from ciuic.errors import ConfigurationError
from ciuic.format import layout
from ciuic.manager.interval import AutoInterval
from ciuic.store import Store

Location = str | os.PathLike[str] | Store | None
T = TypeVar("T")


def option(default: T, doc: str) -> T:
    """A field of :class:`ManagerOptions`: its default and its documentation (the one place
    each option is described)."""
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class ManagerOptions:
    """The arguments of :class:`~ciuic.manager.SnapshotManager`, as given; :meth:`check`
    makes them a :class:`ManagerConfig`."""

    project_id: str = field(metadata={
        "doc": "the project (a name: letters, digits, ``.``, ``_``, ``-``)."})
    api_key: str | None = option(None, """the key for a ciuic server (or ``CIUIC_API_KEY``);
        unused with the embedded store.""")
    save_interval: int | str | AutoInterval | None = option(1000, """snapshot when
        ``step % save_interval == 0`` (None or 0: never by steps). ``"auto"``: the interval
        sets itself, in time, from the measured cost of a snapshot (stall plus in-run slowdown)
        and the job's observed failure rate, by Young/Daly's rule ``sqrt(2 * cost * MTBF)``,
        within 1 % overhead and an hour between snapshots (:class:`~ciuic.AutoInterval` for
        other bounds); ``stats.interval_s`` shows the current choice and
        ``stats.interval_reason`` why.""")
    encryption: bool = option(False, """seal every object with AES-256-GCM on the client, with
        the key from ``CIUIC_ENCRYPTION_KEY`` or ``CIUIC_ENCRYPTION_KEY_FILE``
        (``ciuic keygen``).""")
    _: KW_ONLY
    job: str | None = option(None, """the job within the project (default ``"default"``). The
        same project and job restarted means the same chain.""")
    store: Location = option(None, """a directory, a URL or a :class:`~ciuic.store.Store`;
        default ``$CIUIC_HOME``, else ``./.ciuic``.""")
    time_interval_s: float | str | None = option(None, """also snapshot when this many seconds
        passed since the last one (``"auto"``: the same as ``save_interval="auto"``; the step
        trigger is then off).""")
    keep_last: int | None = option(None, """keep only the N snapshots with the highest steps
        (plus ``keep_every``).""")
    keep_every: int | None = option(None, """also keep every snapshot whose step is a multiple
        of K.""")
    handle_signals: bool = option(True, """on SIGTERM/SIGINT, snapshot at the next ``step()``
        and exit.""")
    asynchronous: bool = option(True, """``step()`` blocks only while the state is copied into
        reused host buffers; chunking, hashing, writing and the commit run in a background
        thread. With False, ``step()`` returns once the snapshot is committed.""")
    on_busy: str = option("wait", """what ``step()`` does when a snapshot is due while the
        previous one is still being written: ``"wait"`` for it (the default, like Orbax: every
        due snapshot is taken; the wait is logged once) or ``"skip"`` the new one (counted in
        ``stats.skipped``; training never waits).""")
    staging_budget_bytes: int | None = option(None, """the most host memory the staging buffers
        may take (default: the state's size). A state over the budget is written
        synchronously, with a warning.""")
    mirror: str | Store | None = option(None, """a second, durable tier (e.g.
        ``"s3://bucket/prefix"``; or ``$CIUIC_MIRROR``) that every object is mirrored to;
        restores fall back to it when the store has lost or damaged an object.""")
    durability: str | None = option(None, """with a mirror, when a snapshot counts as
        committed: ``"local"`` (the default; uploaded in the background, in write order) or
        ``"remote"`` (once the mirror holds it).""")
    compression: str = option("auto", """lossless float compression of chunks (byte planes,
        ``ciuic.floatcodec``): ``"auto"`` (compress a float kind when the store is slow enough
        for it to pay, see ``ciuic.engine.compression``), ``"on"`` or ``"off"``.""")
    overlap: bool = option(False, """(opt-in, asynchronous only) copy the parameters and
        optimizer state while the next forward/backward runs instead of inside ``step()``; the
        optimizer's next ``step()`` waits for the copy to finish (a step pre-hook). Only the
        optimizer may change parameters or optimizer state between ``manager.step()`` and the
        next ``optimizer.step()``; buffers, RNG and extras are still copied inside
        ``step()``.""")
    endpoint: str | None = option(None, """a ciuic server (``ciuic serve``), e.g.
        ``"https://ciuic.example.com"``; or ``CIUIC_ENDPOINT``. The project's snapshots then
        live on the server; everything else (encryption, incremental uploads, restore) works as
        with a local store.""")
    distributed: bool | None = option(None, """under ``torchrun`` (an initialized process group
        of two or more ranks) snapshots are multi-rank and every rank must build its manager at
        the same point (default: detected). ``False``: this process snapshots alone, as if it
        were the only one (e.g. a manager built on rank 0 only, for rank 0's own state).""")
    health: bool | HealthPolicy = option(True, """compute every float tensor's statistics
        (NaN/Inf counts, min, max, mean, L2 norm) while the snapshot is hashed, and mark a
        snapshot unhealthy when a tensor holds NaN or Inf, the loss is not finite or spikes, or
        a weight's norm jumps (``ciuic log`` shows it; ``JOB@healthy`` and
        ``restore(snapshot="healthy")`` skip it). True (the default), False, or a
        :class:`~ciuic.HealthPolicy` for other thresholds.""")

    def check(self) -> ManagerConfig:
        """Check every option; raise :class:`ConfigurationError` naming the first bad one."""
        project = layout.check_name("project", self.project_id)
        job = layout.check_name("job", self.job or "default")
        save_interval: Any = self.save_interval
        time_interval_s: Any = self.time_interval_s
        auto = None
        for name, value in (("save_interval", save_interval),
                            ("time_interval_s", time_interval_s)):
            if isinstance(value, str) and value != "auto":
                raise ConfigurationError(f"{name} must be a number, None or 'auto', got "
                                         f"{value!r}")
            if value == "auto" or isinstance(value, AutoInterval):
                auto = value if isinstance(value, AutoInterval) else AutoInterval()
        if auto is not None:
            if time_interval_s not in (None, "auto") and not isinstance(time_interval_s,
                                                                        AutoInterval):
                raise ConfigurationError(
                    f"save_interval='auto' chooses the time between snapshots itself: drop "
                    f"time_interval_s={time_interval_s!r}, or bound the choice with "
                    "save_interval=AutoInterval(max_interval_s=...)")
            # the automatic interval is a time interval: the step trigger is off
            save_interval = time_interval_s = None
        _positive("time_interval_s", time_interval_s)
        if save_interval is not None and (not isinstance(save_interval, int)
                                          or isinstance(save_interval, bool) or save_interval < 0):
            raise ConfigurationError(f"save_interval must be a step count >= 0 or None, "
                                     f"got {save_interval!r}")
        for name, value in (("keep_last", self.keep_last), ("keep_every", self.keep_every)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"{name} must be an integer >= 1 or None, got {value!r}")
        endpoint = self.endpoint or os.environ.get("CIUIC_ENDPOINT") or None
        if endpoint is not None and self.store is not None:
            raise ConfigurationError("pass either store= or a server endpoint (endpoint= or "
                                     "CIUIC_ENDPOINT), not both")
        if self.compression not in COMPRESSION_MODES:
            raise ConfigurationError(f"compression must be one of {COMPRESSION_MODES}, got "
                                     f"{self.compression!r}")
        health: Any = self.health
        if health is True:
            health = HealthPolicy()
        elif health is False or health is None:
            health = None
        elif not isinstance(health, HealthPolicy):
            raise ConfigurationError(f"health must be True, False or a ciuic.HealthPolicy, got "
                                     f"{health!r}")
        if self.on_busy not in ("skip", "wait"):
            raise ConfigurationError(f"on_busy must be 'skip' or 'wait', got {self.on_busy!r}")
        given = {f.name: getattr(self, f.name) for f in fields(ManagerOptions)}
        return ManagerConfig(**given | {
            "project": project, "job": job, "save_interval": save_interval or None,
            "time_interval_s": time_interval_s, "endpoint": endpoint, "health": health,
            "auto_interval": auto})


@dataclass(frozen=True, kw_only=True)
class ManagerConfig(ManagerOptions):
    """What a manager was asked to do: its options checked (:meth:`ManagerOptions.check`). The
    fields below are those that checking changes or adds; the others are as given."""

    #: ``project_id``, checked
    project: str
    job: str = "default"
    #: a step count, or None (0 and ``"auto"`` are None)
    save_interval: int | None = 1000
    #: seconds, or None (``"auto"`` is None)
    time_interval_s: float | None = None
    #: when a snapshot is judged unhealthy; None: no statistics and no judgment. (The option's
    #: True and False are replaced by what they mean: a narrower type but for None, hence the
    #: ignore.)
    health: HealthPolicy | None = field(  # type: ignore[assignment]
        default_factory=HealthPolicy)
    #: ``save_interval="auto"`` (or ``time_interval_s="auto"``): the interval sets itself
    auto_interval: AutoInterval | None = None

    @property
    def retains(self) -> bool:
        """Whether snapshots are pruned after each commit (``keep_last`` / ``keep_every``)."""
        return self.keep_last is not None or self.keep_every is not None


def options_doc(indent: str = "    ") -> str:
    """The ``Args:`` section of a docstring, from each option's documentation: one entry per
    field of :class:`ManagerOptions`, in the signature's order."""
    out = [f"{indent}Args:"]
    for f in fields(ManagerOptions):
        out += textwrap.wrap(f"{f.name}: {' '.join(f.metadata['doc'].split())}", width=92,
                             initial_indent=indent * 2, subsequent_indent=indent * 3)
    return "\n".join(out) + "\n"


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
