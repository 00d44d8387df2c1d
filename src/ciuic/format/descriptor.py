"""The tensor descriptor: how a body describes one tensor's bytes (docs/format.md, "Tensor
descriptors").

A descriptor is a JSON object inside a state tree (``{"$tensor": {...}}``); this module is its
one typed form, with one :meth:`TensorDescriptor.to_json` (the writer's) and one
:meth:`TensorDescriptor.from_json` (the reader's, which checks every field). Its fields::

    dtype, shape, nbytes          always
    inline                        the bytes, base64, for a small tensor; or
    chunks                        [[digest, nbytes], ...] in order, a piece inside a pack
                                  [digest, nbytes, pack, offset, stored]; or
    shards                        a multi-rank tensor's boxes: each {offsets, shape, nbytes,
                                  chunks or inline[, stats]}
    stats                         a float tensor's statistics (format/stats.py), when judged

Fields a later ciuic adds are kept in ``extra``, so a descriptor read and written again keeps
its bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ciuic.errors import IntegrityError

_T = TypeVar("_T")

@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a tensor's bytes: its digest (the object's name) and its length; for a
    piece inside a pack (format.md, "Packs"), the pack's name, where the piece starts in it
    and how many bytes it takes there (framed or sealed, as a chunk object's are)."""

    digest: str
    nbytes: int
    pack: str | None = None
    offset: int = 0
    stored: int = 0

    def to_json(self) -> list[Any]:
        if self.pack is None:
            return [self.digest, self.nbytes]
        return [self.digest, self.nbytes, self.pack, self.offset, self.stored]

    @property
    def plain(self) -> ChunkRef:
        """The same bytes, named without a place (what two refs of equal bytes share)."""
        return self if self.pack is None else ChunkRef(self.digest, self.nbytes)


@dataclass(frozen=True)
class Shard:
    """One box of a multi-rank tensor: where it lies in the global tensor, and its bytes
    (``chunks`` or ``inline``) in the tensor's dtype."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    nbytes: int
    inline: str | None = None
    chunks: tuple[ChunkRef, ...] | None = None
    stats: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "offsets": list(self.offsets), **_json(self)}

    @classmethod
    def from_json(cls, obj: Any, path: str = "tensor") -> Shard:
        def build(o: dict[str, Any]) -> Shard:
            return cls(offsets=_ints(o["offsets"]), shape=_ints(o["shape"]),
                       nbytes=_int(o["nbytes"]), inline=_maybe(o, "inline", _text),
                       chunks=_maybe(o, "chunks", _chunks), stats=_maybe(o, "stats", _mapping),
                       extra={k: v for k, v in o.items() if k not in _SHARD_FIELDS})
        return _checked(obj, path, build, shards=False)


@dataclass(frozen=True)
class TensorDescriptor:
    """One tensor as a body describes it: exactly one of ``inline``, ``chunks`` and
    ``shards`` holds its bytes."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    inline: str | None = None
    chunks: tuple[ChunkRef, ...] | None = None
    shards: tuple[Shard, ...] | None = None
    stats: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out = {**self.extra, "dtype": self.dtype, **_json(self)}
        if self.shards is not None:
            out["shards"] = [s.to_json() for s in self.shards]
        return out

    @classmethod
    def from_json(cls, obj: Any, path: str = "tensor") -> TensorDescriptor:
        """A descriptor read from a body; :class:`IntegrityError` naming ``path`` when a field
        is missing or of the wrong type, or its byte counts do not add up."""
        def build(o: dict[str, Any]) -> TensorDescriptor:
            return cls(dtype=_text(o["dtype"]), shape=_ints(o["shape"]),
                       nbytes=_int(o["nbytes"]), inline=_maybe(o, "inline", _text),
                       chunks=_maybe(o, "chunks", _chunks),
                       shards=_maybe(o, "shards", lambda v: tuple(
                           Shard.from_json(s, path) for s in _list(v))),
                       stats=_maybe(o, "stats", _mapping),
                       extra={k: v for k, v in o.items() if k not in _FIELDS})
        return _checked(obj, path, build, shards=True)


_FIELDS = ("dtype", "shape", "nbytes", "inline", "chunks", "shards", "stats")
_SHARD_FIELDS = ("offsets", "shape", "nbytes", "inline", "chunks", "stats")
_D = TypeVar("_D", Shard, TensorDescriptor)


def _json(d: Shard | TensorDescriptor) -> dict[str, Any]:
    """The fields a shard and a descriptor share, as JSON."""
    out: dict[str, Any] = {"shape": list(d.shape), "nbytes": d.nbytes}
    if d.inline is not None:
        out["inline"] = d.inline
    if d.chunks is not None:
        out["chunks"] = [c.to_json() for c in d.chunks]
    if d.stats is not None:
        out["stats"] = dict(d.stats)
    return out


def _checked(obj: Any, path: str, build: Callable[[dict[str, Any]], _D], shards: bool) -> _D:
    try:
        if not isinstance(obj, dict):
            raise TypeError(f"a descriptor is an object, got {type(obj).__name__}")
        d = build(obj)
    except IntegrityError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"{path}: malformed tensor descriptor: {e}") from e
    held = [d.inline is not None, d.chunks is not None,
            shards and getattr(d, "shards", None) is not None]
    if sum(held) != 1:
        holders = "'inline', 'chunks' and 'shards'" if shards else "'inline' and 'chunks'"
        raise IntegrityError(f"{path}: malformed tensor descriptor: it needs one of {holders}")
    if d.chunks is not None and sum(c.nbytes for c in d.chunks) != d.nbytes:
        raise IntegrityError(f"{path}: chunk sizes do not add up to {d.nbytes} bytes")
    return d


def _maybe(obj: dict[str, Any], name: str, parse: Callable[[Any], _T]) -> _T | None:
    v = obj.get(name)
    return None if v is None else parse(v)


def _chunks(v: Any) -> tuple[ChunkRef, ...]:
    return tuple(_chunk(c) for c in _list(v))


def parse_chunk(c: Any, path: str = "a chunk reference") -> ChunkRef:
    """A chunk reference as JSON holds it; :class:`IntegrityError` where it is malformed."""
    try:
        return _chunk(c)
    except (TypeError, ValueError) as e:
        raise IntegrityError(f"{path}: {e}") from e


def _chunk(c: Any) -> ChunkRef:
    if isinstance(c, list) and len(c) == 2:
        return ChunkRef(_text(c[0]), _int(c[1]))
    if isinstance(c, list) and len(c) == 5:
        ref = ChunkRef(_text(c[0]), _int(c[1]), _text(c[2]), _int(c[3]), _int(c[4]))
        if ref.offset < 0 or ref.stored < 0:
            _bad(f"a piece's offset and stored bytes are 0 or more, got {c!r}")
        return ref
    raise TypeError(f"a chunk is [digest, nbytes] or [digest, nbytes, pack, offset, stored], "
                    f"got {c!r}")


def _bad(message: str) -> Any:
    raise TypeError(message)


def _text(v: Any) -> str:
    return v if isinstance(v, str) else _bad(f"expected text, got {v!r}")


def _int(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else _bad(
        f"expected an integer, got {v!r}")


def _list(v: Any) -> list[Any]:
    return v if isinstance(v, list) else _bad(f"expected a list, got {v!r}")


def _ints(v: Any) -> tuple[int, ...]:
    return tuple(_int(x) for x in _list(v))


def _mapping(v: Any) -> Mapping[str, Any]:
    return v if isinstance(v, dict) else _bad(f"expected an object, got {v!r}")


def holds_packed(tree: Any) -> bool:
    """Whether a state tree (or any JSON holding descriptors) references a piece inside a pack
    (a chunk reference of five fields): its body takes the packed format (format.md)."""
    if isinstance(tree, dict):
        chunks = tree.get("chunks")
        if isinstance(chunks, list) and any(isinstance(c, list) and len(c) == 5
                                            for c in chunks):
            return True
        return any(holds_packed(v) for v in tree.values() if isinstance(v, dict | list))
    if isinstance(tree, list):
        return any(holds_packed(v) for v in tree if isinstance(v, dict | list))
    return False


def refs_in(tree: Any) -> dict[str, ChunkRef]:
    """Every chunk reference in ``tree`` (a state tree, a body part's shards), by digest."""
    out: dict[str, ChunkRef] = {}

    def walk(v: Any) -> None:
        if isinstance(v, dict):
            chunks = v.get("chunks")
            if isinstance(chunks, list):
                for c in chunks:
                    ref = parse_chunk(c)
                    out[ref.digest] = ref
            for w in v.values():
                if isinstance(w, dict | list):
                    walk(w)
        elif isinstance(v, list):
            for w in v:
                if isinstance(w, dict | list):
                    walk(w)

    walk(tree)
    return out
