"""The one wrapper every ciuic collective goes through (docs/architecture.md, "Multi-rank").

:class:`Collective` works the same with and without ``torch.distributed``: in a single process
(no process group, or a world of one) every call returns at once with this process's value.
Under ``torchrun`` it owns two gloo groups of its own, created when the manager is built (every
rank builds its manager at the same point of the program, as ``new_group`` requires):

- ``control``: the training thread's per-step agreement (is a snapshot due, is one busy, did a
  signal arrive) and the restore's agreement;
- ``data``: the background writer's plan and two-phase commit.

So ciuic never issues a collective on the training's own process group (NCCL on GPUs), and its
two threads never interleave collectives on one group. Payloads are JSON (encoded to bytes, sent
as uint8 tensors): nothing ciuic receives from another rank is unpickled.

:meth:`Collective.run` runs a function on every rank and exchanges the outcomes: when any rank
raised, every rank raises a :class:`~ciuic.errors.RankError` that names each failed rank and its
error, so no rank is left waiting in a later collective for a peer that gave up.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as tdist

from ciuic import knobs
from ciuic.errors import RankError

log = logging.getLogger("ciuic")
T = TypeVar("T")
Json = Any


def active() -> bool:
    """Whether this process is one rank of an initialized process group of two or more."""
    return tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1


class Collective:
    """ciuic's collectives over its own gloo groups; trivial in a single process."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = active() if enabled is None else enabled
        self.rank = tdist.get_rank() if self.enabled else 0
        self.world_size = tdist.get_world_size() if self.enabled else 1
        self._control: Any = None
        self._data: Any = None
        if self.enabled:
            timeout = dt.timedelta(seconds=knobs.get().dist_timeout_s)
            self._control = tdist.new_group(backend="gloo", timeout=timeout)
            self._data = tdist.new_group(backend="gloo", timeout=timeout)

    @property
    def coordinator(self) -> bool:
        """Rank 0 commits snapshots, owns the lease and the catalog's run records."""
        return self.rank == 0

    def close(self) -> None:
        for group in (self._control, self._data):
            if group is not None:
                try:
                    tdist.destroy_process_group(group)
                except Exception as e:  # the default group may already be gone
                    log.debug("could not destroy a ciuic process group: %s", e)
        self._control = self._data = None
        self.enabled = False

    def _group(self, data: bool) -> Any:
        return self._data if data else self._control

    # -- primitives (JSON payloads) ----------------------------------------------------------

    def _padded(self, value: Json, group: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``value`` encoded and padded to the longest of every rank's, and every rank's size."""
        payload = _encode(value)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        tdist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64),
                         group=group)
        padded = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8)
        padded[:payload.numel()] = payload
        return padded, sizes

    def all_gather(self, value: Json, *, data: bool = False) -> list[Json]:
        """Every rank's ``value``, indexed by rank."""
        if not self.enabled:
            return [value]
        group = self._group(data)
        padded, sizes = self._padded(value, group)
        out = [torch.empty_like(padded) for _ in range(self.world_size)]
        tdist.all_gather(out, padded, group=group)
        return [_decode(t[:int(n.item())]) for t, n in zip(out, sizes, strict=True)]

    def gather(self, value: Json, *, data: bool = False) -> list[Json] | None:
        """Every rank's ``value`` at the coordinator (indexed by rank); None elsewhere."""
        if not self.enabled:
            return [value]
        group = self._group(data)
        padded, sizes = self._padded(value, group)
        out = ([torch.empty_like(padded) for _ in range(self.world_size)]
               if self.coordinator else None)
        tdist.gather(padded, out, dst=0, group=group)  # our groups span every rank
        if out is None:
            return None
        return [_decode(t[:int(n.item())]) for t, n in zip(out, sizes, strict=True)]

    def broadcast(self, value: Json, *, data: bool = False) -> Json:
        """The coordinator's ``value`` on every rank (other ranks' ``value`` is ignored)."""
        if not self.enabled:
            return value
        group = self._group(data)
        payload = _encode(value) if self.coordinator else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        tdist.broadcast(size, src=0, group=group)
        if not self.coordinator:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        tdist.broadcast(payload, src=0, group=group)
        return _decode(payload)

    def start_max(self, values: list[int]) -> Callable[[], list[int]]:
        """Start an element-wise maximum over ranks on the control group without waiting;
        the returned function waits and gives the result."""
        if not self.enabled:
            return lambda: list(values)
        t = torch.tensor(values, dtype=torch.int64)
        work = tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=self._control, async_op=True)

        def result() -> list[int]:
            work.wait()
            return [int(v) for v in t.tolist()]

        return result

    def all_reduce(self, t: torch.Tensor, op: str, *, data: bool = False) -> torch.Tensor:
        """The element-wise ``"sum"`` or ``"max"`` of ``t`` over every rank (in place; ``t``
        itself in a single process)."""
        if self.enabled:
            ops = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX}
            tdist.all_reduce(t, op=ops[op], group=self._group(data))
        return t

    # -- error-propagating steps -------------------------------------------------------------

    def run(self, what: str, fn: Callable[[], T], *, data: bool = False) -> T:
        """Run ``fn`` on every rank; if it raised anywhere, raise :class:`RankError` (naming
        every failed rank) on every rank. Returns this rank's result. In a single process,
        ``fn``'s own exception propagates unchanged."""
        if not self.enabled:
            return fn()
        try:
            result: T | None = fn()
            error = None
        except Exception as e:
            result, error = None, f"{type(e).__name__}: {e}"
        self.agree(what, error, data=data)
        return result  # type: ignore[return-value]

    def agree(self, what: str, error: str | None, *, data: bool = False) -> None:
        """Exchange each rank's error (None: fine); raise :class:`RankError` everywhere if any
        rank has one."""
        if not self.enabled:
            if error is not None:
                raise RankError(what, {0: error})
            return
        errors = self.all_gather(error, data=data)
        failures = {r: str(e) for r, e in enumerate(errors) if e is not None}
        if failures:
            raise RankError(what, failures)


def _encode(value: Json) -> torch.Tensor:
    raw = json.dumps(value, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(
        0, dtype=torch.uint8)


def _decode(t: torch.Tensor) -> Json:
    return json.loads(bytes(t.numpy().tobytes()).decode())
