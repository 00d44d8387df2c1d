"""Canonical JSON: the byte encoding of every manifest and body.

Rules (docs/format.md, "Canonical JSON"):

* UTF-8, object keys sorted by code point, no insignificant whitespace (``,`` and ``:``);
* values are objects, arrays, strings, integers, ``true``, ``false`` and ``null``;
* no floating-point numbers anywhere (they are written as tagged strings, see ``ciuic.tree``),
  so the bytes, and therefore every digest, are the same on every platform;
* arrays and objects nest at most :data:`MAX_DEPTH` levels.

:func:`parse` is the one reader of JSON that comes from outside the process (a store's objects,
a catalog's rows, a server's answers): whatever the bytes, it returns a value or raises
:class:`~ciuic.errors.CorruptObject` naming them, never another exception (a deeply nested
``[[[[...`` is a ``RecursionError`` in :func:`json.loads`).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from ciuic.errors import CaptureError, CorruptObject
from ciuic.format.digest import digest

#: how deep arrays and objects may nest (``[[1]]`` is 2): a state tree is a few levels deep; a
#: reader refuses deeper JSON as damaged (every reader of a tree recurses), a writer refuses to
#: write it
MAX_DEPTH = 100

_QUOTED = re.compile(rb'"[^"]*"')
_NOT_BRACKET_OR_QUOTE = bytes(c for c in range(256) if c not in b'[]{}"')
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def _check(value: Any, where: str, depth: int = 0) -> None:
    if isinstance(value, (dict, list)) and depth >= MAX_DEPTH:
        at = where if len(where) <= 60 else where[:60] + "..."
        raise CaptureError(f"canonical JSON: {at or 'the value'} nests deeper than "
                           f"{MAX_DEPTH} levels of lists and dicts; store a flatter value")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"canonical JSON: non-string key {k!r} at {where}")
            _check(v, f"{where}/{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check(v, f"{where}[{i}]", depth + 1)
    elif isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return
    else:
        raise TypeError(
            f"canonical JSON: {type(value).__name__} at {where} is not allowed "
            "(only objects, arrays, strings, integers, booleans and null)"
        )


def dumps(value: Any) -> bytes:
    """Encode ``value`` canonically. Raises ``TypeError`` on floats or other types, and
    :class:`~ciuic.errors.CaptureError` (a ``TypeError``) on a value nested too deeply."""
    _check(value, "")
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def depth(data: bytes) -> int:
    """How deep the arrays and objects of valid JSON ``data`` nest (``[[1],{}]`` is 2), counted
    without recursion: the brackets outside its strings. In byte operations (a tenth of the
    parse's time): escaped backslashes and quotes out, then all but brackets and quotes, then
    the strings (quotes and the brackets between them)."""
    unescaped = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = unescaped.translate(None, _NOT_BRACKET_OR_QUOTE).replace(b'""', b"")
    brackets = _QUOTED.sub(b"", marks) if b'"' in marks else marks
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0)


def loads(data: bytes) -> Any:
    """Decode canonical JSON. Floats are rejected: they are never written. Any defect of the
    bytes (not UTF-8, not JSON, a float, nested deeper than :data:`MAX_DEPTH`) is a
    ``ValueError``."""
    return _loads(data, floats=False)


def parse(data: bytes | str, key: str, what: str = "JSON", *, floats: bool = False) -> Any:
    """Decode JSON read from outside the process: a value, or :class:`CorruptObject` naming
    ``key`` (``what`` says what it should have been: "manifest", "lease", ...) whatever is wrong
    with the bytes. ``floats``: accept floating-point numbers (plain JSON, not canonical)."""
    try:
        return _loads(data.encode("utf-8") if isinstance(data, str) else data, floats=floats)
    except ValueError as e:
        raise CorruptObject(key, f"not a readable {what}: {e}") from None


def _loads(data: bytes, *, floats: bool) -> Any:
    def no_float(text: str) -> Any:
        raise ValueError(f"floating-point number {text} in canonical JSON")

    raw = bytes(data)  # a bytearray or memoryview too; anything else is a TypeError
    try:
        value = json.loads(raw.decode("utf-8"), parse_float=None if floats else no_float,
                           parse_constant=None if floats else no_float)
    except RecursionError:
        raise ValueError("nested too deeply to parse") from None
    if (found := depth(raw)) > MAX_DEPTH:
        raise ValueError(f"nested {found} levels deep; at most {MAX_DEPTH} are allowed")
    return value


def parse_named(data: bytes, key: str, expected_digest: str, name_key: bytes | None,
                what: str, kind: str) -> dict[str, Any]:
    """An object named by its digest (a body's part, its box table): checked against the name,
    parsed, and its ``kind`` checked; :class:`CorruptObject` naming ``key`` otherwise."""
    actual = digest(data, key=name_key)
    if actual != expected_digest:
        raise CorruptObject(key, f"content hash {actual[:16]}... does not match its name")
    obj = parse(data, key, f"{what} (canonical JSON)")
    if not isinstance(obj, dict) or obj.get("kind") != kind:
        raise CorruptObject(key, f"malformed {what}: not a ciuic {what}")
    return obj
