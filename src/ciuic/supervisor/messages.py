"""The requests a training process sends its supervisor on the local channel
(:mod:`ciuic.supervisor.channel`), typed: a frozen dataclass per kind, built once at the
boundary by :func:`parse`. Whatever arrives that is not one of them (a value of the wrong type,
a missing or unexpected field, a number out of range, an unknown ``op``) is a
:class:`ProtocolError` that says what is wrong; the supervisor answers it and goes on serving.

A request names no rank: the rank is bound to the connection by its first message,
:class:`Hello` (with the secret of this start, ``CIUIC_SUPERVISOR_KEY``).
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ciuic.errors import ProtocolError as ProtocolError  # re-exported: raised here

T = TypeVar("T")
#: no rank, buffer id, step or node of a job is this large
MAX_INT = 1 << 62
#: a chunk a rank asks its node to fetch from another node: no chunk is larger
MAX_CHUNK = 1 << 30
_MAX_TEXT = 1 << 16
_MAX_ITEMS = 1 << 24


@dataclass(frozen=True)
class Hello:
    """The first message of every connection: this start's secret, and the rank the connection
    acts for from then on."""

    secret: str
    rank: int


@dataclass(frozen=True)
class Attach:
    """The heartbeat region, and the host copy this rank left."""

    pid: int


@dataclass(frozen=True)
class Fds:
    """Descriptors of held buffers: this rank's, or (``owner``) another rank's published ones
    (read-only), or a replica's (``owner`` < 0: node ``-1 - owner``, read-only)."""

    ids: tuple[int, ...]
    owner: int | None


@dataclass(frozen=True)
class Put:
    """A staging buffer handed over (with one descriptor): buffer ``id``, ``nbytes`` long."""

    id: int
    path: str
    nbytes: int


@dataclass(frozen=True)
class Free:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Invalidate:
    pass


@dataclass(frozen=True)
class Leaf:
    path: str
    buffer: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    digest: str
    nbytes: int
    buffer: int
    offset: int


@dataclass(frozen=True)
class Publish:
    snapshot: str
    step: int
    ids: tuple[int, ...]
    leaves: tuple[Leaf, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Chunks:
    pass


@dataclass(frozen=True)
class Listen:
    pass


@dataclass(frozen=True)
class Peers:
    """The job's nodes ([group rank, host, port]), this node's group rank, this start's token."""

    token: str
    me: int
    nodes: tuple[tuple[int, str, int], ...]
    keys: tuple[str, ...]


@dataclass(frozen=True)
class Said:
    """What ``ciuic run`` says now about the restart of this start (its cause may be known
    only after the workers attached: another node's word)."""


@dataclass(frozen=True)
class Fetch:
    d: str
    n: int


Request = (Hello | Attach | Fds | Put | Free | Invalidate | Publish | Chunks | Listen | Peers
           | Said | Fetch)


# -- the field checks ---------------------------------------------------------------------------


def _int(lo: int = 0, hi: int = MAX_INT) -> Callable[[Any, str], int]:
    def check(v: Any, where: str) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise ProtocolError(f"{where} must be an integer in {lo}..{hi}, not {_show(v)}")
        return v
    return check


def _text(v: Any, where: str) -> str:
    if not isinstance(v, str) or len(v) > _MAX_TEXT or not _utf8(v):
        raise ProtocolError(f"{where} must be a string of at most {_MAX_TEXT} characters, "
                            f"not {_show(v)}")
    return v


def _word(v: Any, where: str) -> str:
    """A secret, a token, a key or a digest: printable ASCII."""
    if not isinstance(v, str) or len(v) > _MAX_TEXT or not (v.isascii() and v.isprintable()):
        raise ProtocolError(f"{where} must be printable ASCII, not {_show(v)}")
    return v


def _utf8(v: str) -> bool:
    try:
        v.encode()
    except UnicodeEncodeError:  # a lone surrogate, which JSON can carry
        return False
    return True


def _list(v: Any, where: str, n: int | None = None) -> list[Any]:
    if not isinstance(v, list) or len(v) > _MAX_ITEMS or (n is not None and len(v) != n):
        size = "a list" if n is None else f"a list of {n}"
        raise ProtocolError(f"{where} must be {size}, not {_show(v)}")
    return v


def _each(item: Callable[[Any, str], T]) -> Callable[[Any, str], tuple[T, ...]]:
    def check(v: Any, where: str) -> tuple[T, ...]:
        return tuple(item(x, f"{where}[{k}]") for k, x in enumerate(_list(v, where)))
    return check


def _row(*cells: Callable[[Any, str], Any]) -> Callable[[Any, str], tuple[Any, ...]]:
    def check(v: Any, where: str) -> tuple[Any, ...]:
        got = _list(v, where, len(cells))
        return tuple(c(x, f"{where}[{k}]") for k, (c, x) in enumerate(zip(cells, got, strict=True)))
    return check


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 40, 40


def _show(v: Any) -> str:
    """``v`` shortened for a message (however deeply nested: a repr would recurse)."""
    return _REPR.repr(v)


_id = _int()
_ids = _each(_id)
_leaf = _row(_text, _id, _id, _id)
_chunk = _row(_word, _id, _id, _id)

#: op -> (the dataclass, {field: (check, default)}); a field without default is required
_REQUIRED = object()
_KINDS: dict[str, tuple[type[Any], dict[str, tuple[Callable[[Any, str], Any], Any]]]] = {
    "hello": (Hello, {"secret": (_word, _REQUIRED), "rank": (_id, _REQUIRED)}),
    "attach": (Attach, {"pid": (_id, 0)}),
    "fds": (Fds, {"ids": (_ids, _REQUIRED), "owner": (_int(-MAX_INT), None)}),
    "put": (Put, {"id": (_id, _REQUIRED), "path": (_text, ""), "nbytes": (_id, _REQUIRED)}),
    "free": (Free, {"ids": (_ids, _REQUIRED)}),
    "invalidate": (Invalidate, {}),
    "publish": (Publish, {"snapshot": (_text, _REQUIRED), "step": (_int(-MAX_INT), _REQUIRED),
                          "ids": (_ids, _REQUIRED), "leaves": (_each(_leaf), ()),
                          "chunks": (_each(_chunk), ())}),
    "chunks": (Chunks, {}),
    "listen": (Listen, {}),
    "peers": (Peers, {"token": (_word, _REQUIRED), "me": (_id, _REQUIRED),
                      "nodes": (_each(_row(_id, _text, _int(0, 65535))), _REQUIRED),
                      "keys": (_each(_word), ())}),
    "restart": (Said, {}),
    "fetch": (Fetch, {"d": (_word, _REQUIRED), "n": (_int(1, MAX_CHUNK), _REQUIRED)}),
}


def parse(message: Any) -> Request:
    """The typed request ``message`` (a decoded JSON value) is, or :class:`ProtocolError`."""
    if not isinstance(message, dict):
        raise ProtocolError(f"a request must be a JSON object, not {_show(message)}")
    op = message.get("op")
    kind = _KINDS.get(op) if isinstance(op, str) else None
    if kind is None:
        raise ProtocolError(f"unknown request {_show(op)} (expected one of "
                            f"{', '.join(sorted(_KINDS))})")
    cls, fields = kind
    extra = sorted(set(message) - set(fields) - {"op"})
    if extra:
        raise ProtocolError(f"{op}: unexpected field {_show(extra[0])}"
                            + (" (a connection acts for the rank it said hello as)"
                               if extra[0] == "rank" else ""))
    values = {}
    for name, (check, default) in fields.items():
        if name in message:
            values[name] = check(message[name], f"{op}: {name!r}")
        elif default is _REQUIRED:
            raise ProtocolError(f"{op}: {name!r} is missing")
        else:
            values[name] = default
    if cls is Publish:
        values["leaves"] = tuple(Leaf(*x) for x in values["leaves"])
        values["chunks"] = tuple(Chunk(*x) for x in values["chunks"])
    return cls(**values)  # type: ignore[no-any-return]
