"""The requests between nodes' chunk services (:mod:`ciuic.supervisor.peers`), as typed
records: a frame's JSON header is checked once, here, into one of them, so the server reads no
field of a dict (a malformed request is answered with its fault, and the connection goes on).

- ``ping``: :class:`Ping`;
- ``index``: :class:`Index`;
- ``get {d, n}``: :class:`Get`;
- ``put_begin {src, sid, entries}``: :class:`PutBegin`;
- ``put {d}`` + the chunk's bytes as the frame's payload: :class:`Put`;
- ``put_end``: :class:`PutEnd`.

Only ``put`` carries a payload. The replies' fields the client reads are checked by
:func:`chunk_list`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ciuic.errors import BadRequest
from ciuic.format.digest import is_digest
from ciuic.supervisor.wire import MAX_PAYLOAD_BYTES

#: a replica's entries, and an index's
MAX_ENTRIES = 1 << 24
_MAX_SID = 256


@dataclass(frozen=True)
class Ping:
    def to_json(self) -> dict[str, Any]:
        return {"op": "ping"}


@dataclass(frozen=True)
class Index:
    def to_json(self) -> dict[str, Any]:
        return {"op": "index"}


@dataclass(frozen=True)
class Get:
    d: str
    n: int

    def to_json(self) -> dict[str, Any]:
        return {"op": "get", "d": self.d, "n": self.n}


@dataclass(frozen=True)
class PutBegin:
    src: int
    sid: str
    entries: tuple[tuple[str, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"op": "put_begin", "src": self.src, "sid": self.sid,
                "entries": [list(e) for e in self.entries]}


@dataclass(frozen=True)
class Put:
    d: str
    n: int  # the frame's payload bytes

    def to_json(self) -> dict[str, Any]:
        return {"op": "put", "d": self.d, "n": self.n}


@dataclass(frozen=True)
class PutEnd:
    def to_json(self) -> dict[str, Any]:
        return {"op": "put_end"}


Request = Ping | Index | Get | PutBegin | Put | PutEnd


def _digest(value: object, what: str) -> str:
    if not isinstance(value, str) or not is_digest(value):
        raise BadRequest(f"{what} is not a digest (64 lowercase hex characters)")
    return value


def _count(value: object, what: str, most: int) -> int:
    if type(value) is not int or not 0 <= value <= most:
        raise BadRequest(f"{what} is not a whole number from 0 to {most}")
    return value


def chunk_list(value: object, what: str) -> list[tuple[str, int]]:
    """``[[digest, bytes], ...]`` checked (raises :class:`BadRequest`)."""
    if not isinstance(value, list) or len(value) > MAX_ENTRIES:
        raise BadRequest(f"{what} is not a list of at most {MAX_ENTRIES} chunks")
    out = []
    for e in value:
        if not isinstance(e, list) or len(e) != 2:
            raise BadRequest(f"{what} holds an entry that is not [digest, bytes]")
        out.append((_digest(e[0], f"an entry of {what}"),
                    _count(e[1], f"an entry's bytes in {what}", MAX_PAYLOAD_BYTES)))
    return out


def parse_request(header: dict[str, Any], payload_bytes: int) -> Request:
    """The request a frame's header (and payload length) makes; raises :class:`BadRequest`
    saying what is wrong with it."""
    op = header.get("op")
    req: Request
    if op == "ping":
        req = Ping()
    elif op == "index":
        req = Index()
    elif op == "get":
        req = Get(_digest(header.get("d"), "get's d"),
                  _count(header.get("n"), "get's n", MAX_PAYLOAD_BYTES))
    elif op == "put_begin":
        sid = header.get("sid")
        if not isinstance(sid, str) or not 0 < len(sid) <= _MAX_SID:
            raise BadRequest(f"put_begin's sid is not a name of 1 to {_MAX_SID} characters")
        req = PutBegin(_count(header.get("src"), "put_begin's src", 1 << 20), sid,
                       tuple(chunk_list(header.get("entries"), "put_begin's entries")))
    elif op == "put":
        n = header.get("n", payload_bytes)
        if n != payload_bytes:
            raise BadRequest(f"put's n ({n!r}) is not its payload's {payload_bytes} bytes")
        return Put(_digest(header.get("d"), "put's d"), payload_bytes)
    elif op == "put_end":
        req = PutEnd()
    else:
        raise BadRequest(f"unknown request {str(op)[:40]!r}")
    if payload_bytes:
        raise BadRequest(f"a {op} request with a payload")
    return req
