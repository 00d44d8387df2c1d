"""``StateHolder``: give a plain state (a dict of tensors and values) a state_dict interface."""

from __future__ import annotations

from typing import Any


class StateHolder:
    """Wraps a plain state so it can be snapshotted and restored as an extra.

    ``manager.step(n, model, optimizer, ema=StateHolder({"w": ema_weights}))`` saves it;
    ``manager.restore(model, optimizer, ema=holder)`` puts the restored dict in ``holder.state``.
    """

    def __init__(self, state: dict[str, Any] | None = None) -> None:
        self.state: dict[str, Any] = {} if state is None else state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state
