"""Canonical JSON: the byte encoding of every manifest and body.

Rules (docs/format.md, "Canonical JSON"):

* UTF-8, object keys sorted by code point, no insignificant whitespace (``,`` and ``:``);
* values are objects, arrays, strings, integers, ``true``, ``false`` and ``null``;
* no floating-point numbers anywhere (they are written as tagged strings, see ``ciuic.tree``),
  so the bytes, and therefore every digest, are the same on every platform.
"""

from __future__ import annotations

import json
from typing import Any


def _check(value: Any, where: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"canonical JSON: non-string key {k!r} at {where}")
            _check(v, f"{where}/{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check(v, f"{where}[{i}]")
    elif isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return
    else:
        raise TypeError(
            f"canonical JSON: {type(value).__name__} at {where} is not allowed "
            "(only objects, arrays, strings, integers, booleans and null)"
        )


def dumps(value: Any) -> bytes:
    """Encode ``value`` canonically. Raises ``TypeError`` on floats or other types."""
    _check(value, "")
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def loads(data: bytes) -> Any:
    """Decode canonical JSON. Floats are rejected: they are never written."""

    def no_float(text: str) -> Any:
        raise ValueError(f"floating-point number {text} in canonical JSON")

    return json.loads(data.decode("utf-8"), parse_float=no_float, parse_constant=no_float)
