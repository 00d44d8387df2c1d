"""A multi-rank snapshot's body in parts (docs/format.md, "Distributed snapshots", body format 3).

A body of one object, with every shard's descriptor and every rank's per-rank states, grows as
tensors x ranks: rank 0 gathers and writes all of it, and every rank reads and parses all of it
to find its own boxes (docs/multinode.md, "The model"). Body format 3 splits it:

- each rank writes a **part** (``bodies/<digest>.json``, ``"kind": "ciuic.part"``): the
  descriptors of the shards it wrote (by tensor path), its per-rank states, ``reads``: the
  other ranks whose parts hold boxes of tensors this rank held but did not write (a replica
  written once, as in HSDP), and ``others``: who wrote each piece it held but did not write
  (the plan, for this rank);
- the coordinator writes the **index**, the body the manifest names: the global states, in which
  a sharded tensor's descriptor says ``"split": true`` instead of listing its shards (its dtype,
  global shape, bytes and the whole tensor's statistics stay), ``dist.parts``: every rank's
  part as ``[digest, bytes]``, in rank order, and ``dist.plan``: the digest of every rank's
  layout the plan was made from.

A restore on the same layout reads the index and its own part (and those its part names); a
tool that reads everything, or a restore on another layout, merges every part into the view a
format-2 body gives (:func:`merge`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ciuic.errors import CorruptObject
from ciuic.format import canonical
from ciuic.format.descriptor import holds_packed
from ciuic.format.tree import walk_leaves

SPLIT_BODY_FORMAT = 3
#: a body (or part) that references a piece inside a pack (format.md, "Packs")
PACKED_BODY_FORMAT = 4
PART_KIND = "ciuic.part"


@dataclass(frozen=True)
class BodyPart:
    """One rank's part of a split body."""

    rank: int
    #: tensor path -> the descriptors (JSON, each with ``offsets``) of the shards this rank wrote
    shards: dict[str, list[dict[str, Any]]]
    #: this rank's per-rank states (``rng``, extras), as trees
    state: dict[str, Any]
    #: the other ranks whose parts hold boxes this rank held but did not write
    reads: tuple[int, ...] = ()
    #: the plan's owner of each global piece this rank held but another rank wrote (by
    #: piece key); its other pieces it wrote itself. A rank restored on the same layout
    #: adopts the plan instead of exchanging every rank's metas again.
    others: dict[str, int] = field(default_factory=dict)

    def encode(self) -> bytes:
        fmt = PACKED_BODY_FORMAT if holds_packed(self.shards) or holds_packed(
            self.state) else SPLIT_BODY_FORMAT
        return canonical.dumps({"format": fmt, "kind": PART_KIND,
                                "others": self.others, "rank": self.rank,
                                "reads": list(self.reads), "shards": self.shards,
                                "state": self.state})

    @classmethod
    def decode(cls, data: bytes, key: str, expected_digest: str,
               name_key: bytes | None = None) -> BodyPart:
        """Check a part (plaintext) against its digest and parse it; :class:`CorruptObject`
        naming ``key`` where it is damaged or malformed."""
        obj = canonical.parse_named(data, key, expected_digest, name_key, "body part", PART_KIND)
        try:
            if obj.get("format") not in (SPLIT_BODY_FORMAT, PACKED_BODY_FORMAT):
                raise ValueError(f"part format {obj.get('format')!r} is not "
                                 f"{SPLIT_BODY_FORMAT} or {PACKED_BODY_FORMAT}")
            shards, state, reads = obj["shards"], obj["state"], obj["reads"]
            if not isinstance(shards, dict) or not all(
                    isinstance(v, list) and all(isinstance(s, dict) for s in v)
                    for v in shards.values()):
                raise ValueError("'shards' is not an object of lists of shards")
            if not isinstance(state, dict):
                raise ValueError("'state' is not an object")
            if not isinstance(reads, list) or not all(
                    isinstance(r, int) and not isinstance(r, bool) for r in reads):
                raise ValueError("'reads' is not a list of ranks")
            rank, others = obj["rank"], obj.get("others", {})
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise ValueError("'rank' is not an integer")
            if not isinstance(others, dict) or not all(
                    isinstance(r, int) and not isinstance(r, bool) for r in others.values()):
                raise ValueError("'others' is not an object of ranks")
        except (KeyError, ValueError) as e:
            raise CorruptObject(key, f"malformed body part: {e}") from None
        return cls(rank, shards, state, tuple(reads), others)


def listed_parts(states: dict[str, Any]) -> list[tuple[str, int]] | None:
    """A split body's parts as (digest, bytes) in rank order; None for a body in one piece."""
    dist = states.get("dist")
    if not isinstance(dist, dict) or "parts" not in dist:
        return None
    parts = dist["parts"]
    if not isinstance(parts, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
            and isinstance(p[1], int) for p in parts):
        raise CorruptObject("body", "'dist.parts' is not a list of [digest, bytes]")
    return [(str(d), int(n)) for d, n in parts]


def global_states(states: dict[str, Any]) -> dict[str, Any]:
    """The states that hold global tensors (not ``dist``, not ``ranks``)."""
    return {k: v for k, v in states.items() if k not in ("dist", "ranks")}


def shards_by_path(parts: list[BodyPart]) -> dict[str, list[dict[str, Any]]]:
    """Every shard the parts hold, by tensor path, ordered by offsets."""
    out: dict[str, list[dict[str, Any]]] = {}
    for part in parts:
        for path, shards in part.shards.items():
            out.setdefault(path, []).extend(shards)
    for shards in out.values():
        shards.sort(key=lambda s: list(s.get("offsets", [])))
    return out


def with_shards(desc: dict[str, Any], shards: list[dict[str, Any]]) -> dict[str, Any]:
    """A split descriptor as a sharded one holding ``shards`` (a new dict)."""
    out = {k: v for k, v in desc.items() if k != "split"}
    out["shards"] = shards
    return out


def merge(states: dict[str, Any], parts: list[BodyPart], key: str) -> dict[str, Any]:
    """The index's states with every part merged in, in place: each split descriptor lists all
    its shards, and ``ranks`` holds every rank's per-rank states (the view a body of format 2
    gives). :class:`CorruptObject` naming ``key`` where the parts do not match the index."""
    found = shards_by_path(parts)
    for path, _kind, desc in walk_leaves(global_states(states)):
        if desc.pop("split", None) is True:
            desc["shards"] = found.pop(path, [])
    if found:
        raise CorruptObject(key, f"a part holds shards of {sorted(found)[0]}, which the body "
                                 "does not list as split")
    states["ranks"] = [part.state for part in parts]
    return states
