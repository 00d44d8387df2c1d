"""Adapters: explicit, named conversions for values the state tree cannot hold by itself.

A framework's state carries objects of its own classes: a ``TrainerState`` dataclass, an
``AttributeDict`` of hyper-parameters, an enum. The tree stores none of them by default (it
never pickles, and never imports a class by a name read from a snapshot). An adapter says, for
one class, how to turn a value into a plain tree value and back::

    register_adapter(TrainerState, "transformers.TrainerState",
                     save=dataclasses.asdict, load=lambda d: TrainerState(**d))

A value of that class (or of a subclass, unless a closer adapter exists) is then stored as
``{"$adapted": {"type": "transformers.TrainerState", "value": <tree>}}`` and comes back through
``load`` -- but only in a process where the same name is registered, by the code that knows the
class (the integrations register theirs on import). An unknown name on the load path is a clear
:class:`~ciuic.errors.ConfigurationError`, never a guess.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ciuic.errors import ConfigurationError

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,127}$")


@dataclass(frozen=True)
class Adapter:
    cls: type
    name: str
    save: Callable[[Any], Any]
    load: Callable[[Any], Any]


_by_type: dict[type, Adapter] = {}
_by_name: dict[str, Adapter] = {}
_lock = threading.Lock()


def register_adapter(cls: type, name: str, *, save: Callable[[Any], Any],
                     load: Callable[[Any], Any]) -> None:
    """Store values of ``cls`` as ``save(value)`` under ``name``; read them with ``load``.

    ``save`` must return what a snapshot holds (tensors, arrays, JSON-like values, or values
    with adapters). Registering the same class under the same name again replaces the
    functions; a name or class already taken by another registration is a mistake.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_adapter: cls must be a class, got {cls!r}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigurationError(
            f"adapter name {name!r} is not valid: use letters, digits and . _ : - (at most 128), "
            "such as 'mylib.TrainState'")
    if not callable(save) or not callable(load):
        raise TypeError("register_adapter: save and load must be callables")
    with _lock:
        taken = _by_name.get(name)
        if taken is not None and taken.cls is not cls:
            raise ConfigurationError(
                f"adapter name {name!r} is already registered for {_qualname(taken.cls)}; "
                f"choose another name for {_qualname(cls)}")
        old = _by_type.get(cls)
        if old is not None and old.name != name:
            raise ConfigurationError(
                f"{_qualname(cls)} already has the adapter {old.name!r}; a class has one name "
                "(snapshots written under it must stay readable)")
        adapter = Adapter(cls, name, save, load)
        _by_type[cls] = _by_name[name] = adapter


def adapter_for(value: Any) -> Adapter | None:
    """The adapter for ``value``'s class, or for its nearest registered base class."""
    exact = _by_type.get(type(value))
    if exact is not None or not _by_type:
        return exact
    for base in type(value).__mro__[1:]:
        found = _by_type.get(base)
        if found is not None:
            return found
    return None


def exact_adapter(value: Any) -> Adapter | None:
    """The adapter registered for exactly ``value``'s class (checked before the built-in
    forms, so that a registered dict or tuple subclass keeps its class)."""
    return _by_type.get(type(value)) if _by_type else None


def load_adapted(name: str, value: Any, path: str) -> Any:
    adapter = _by_name.get(name)
    if adapter is None:
        raise ConfigurationError(
            f"{path or 'value'}: the snapshot stores a {name!r} through an adapter that this "
            "process has not registered. Import the integration that writes it (for example "
            "ciuic.integrations.transformers) or call ciuic.register_adapter(...) for it before "
            "restoring.")
    try:
        return adapter.load(value)
    except Exception as e:
        raise ConfigurationError(
            f"{path or 'value'}: the adapter {name!r} could not rebuild its value from the "
            f"snapshot ({type(e).__name__}: {e})") from e


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
