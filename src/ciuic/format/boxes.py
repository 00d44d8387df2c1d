"""The box table of a split body (docs/format.md, "Box table"): which ranks' parts hold which box
of the sharded tensors, per layout class, so that a rank restoring on another layout reads only
the parts that meet its own boxes (issue #45, item 2).

Without it, nothing but the parts says which rank wrote which box, and a rank restoring on
another world size reads every part: O(T x W) per rank (9.7 GB at 16,384 ranks of a 70B
model). Listing every shard's box in the index would be as large (DCP's ``.metadata``). But the
tensors of a model are sharded a few ways only: tensors of one *layout class* (the same global
shape, placements and device mesh: :func:`ciuic.format.tree.dtensor_layout`) hold the same box
on every rank. So each rank reports, per class, the box it holds; the coordinator writes one
table object (``bodies/<digest>.json``, ``"kind": "ciuic.boxes"``) of classes x W boxes, each
with the ranks that hold it (several for a replica, as under HSDP: the one that wrote it is
among them), and the index names it (``dist.boxes``: ``[digest, bytes]``).

A rank restoring on another layout reads the table, and for each class the boxes that meet
its own (once per class, not per tensor), and reads those ranks' parts. The parts read must
still tile each box it needs (``distributed/load._covers``); where they do not, or a tensor is
in no class, it reads every part, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ciuic.errors import CorruptObject
from ciuic.format import canonical

BOXES_KIND = "ciuic.boxes"
BOXES_FORMAT = 1

#: a box of a class: (its offsets, its shape, the ranks that hold it)
Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class BoxTable:
    """Per layout class: the paths of its tensors, and its boxes."""

    classes: tuple[tuple[tuple[str, ...], tuple[Box, ...]], ...]

    @classmethod
    def build(cls, paths: Mapping[str, Iterable[str]],
              held: Iterable[tuple[int, Iterable[tuple[str, list[int], list[int]]]]]
              ) -> BoxTable:
        """From each class's paths (as the coordinator knows them) and each rank's reported
        ``(class, offsets, shape)`` of the boxes it holds. A class no path is known for is left
        out (its tensors, if any, are read from every part)."""
        boxes: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]]] = {}
        for rank, reported in held:
            for name, offsets, shape in reported:
                if name in paths:
                    box = (tuple(int(x) for x in offsets), tuple(int(x) for x in shape))
                    boxes.setdefault(name, {}).setdefault(box, []).append(int(rank))
        classes = []
        for name in sorted(boxes):
            listed = tuple(sorted((off, shape, tuple(sorted(ranks)))
                                  for (off, shape), ranks in boxes[name].items()))
            classes.append((tuple(sorted(paths[name])), listed))
        return cls(tuple(classes))

    def encode(self) -> bytes:
        return canonical.dumps({"format": BOXES_FORMAT, "kind": BOXES_KIND, "classes": [
            {"paths": list(p), "boxes": [[list(o), list(s), list(r)] for o, s, r in b]}
            for p, b in self.classes]})

    @classmethod
    def decode(cls, data: bytes, key: str, expected_digest: str,
               name_key: bytes | None = None) -> BoxTable:
        """Check a table (plaintext) against its digest and parse it; :class:`CorruptObject`
        naming ``key`` where it is damaged or malformed."""
        obj = canonical.parse_named(data, key, expected_digest, name_key, "box table", BOXES_KIND)
        try:
            if obj.get("format") != BOXES_FORMAT:
                raise ValueError(f"box table format {obj.get('format')!r} is not "
                                 f"{BOXES_FORMAT}: upgrade ciuic")
            classes = []
            for c in obj["classes"]:
                paths = tuple(str(p) for p in _list(c["paths"], str))
                boxes = tuple((_ints(o), _ints(s), _ints(r)) for o, s, r in _list(c["boxes"], list))
                classes.append((paths, boxes))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptObject(key, f"malformed box table: {e}") from None
        return cls(tuple(classes))

    def ranks_for(self, wanted: Mapping[str, tuple[list[int], list[int]]]) -> set[int] | None:
        """The ranks whose parts hold every box of ``wanted`` (tensor path -> the box a rank
        needs of it); None where a path is in no class (then every part is read)."""
        of: dict[str, int] = {p: i for i, (paths, _) in enumerate(self.classes) for p in paths}
        met: dict[tuple[int, tuple[int, ...], tuple[int, ...]], set[int]] = {}
        out: set[int] = set()
        for path, (off, shape) in wanted.items():
            i = of.get(path)
            if i is None:
                return None
            key = (i, tuple(off), tuple(shape))
            ranks = met.get(key)
            if ranks is None:  # once per class and box, not per tensor
                ranks = met[key] = {r for o, s, holders in self.classes[i][1]
                                    if overlap(list(o), list(s), off, shape) is not None
                                    for r in holders}
            out |= ranks
        return out


def overlap(a_off: list[int], a_shape: list[int], b_off: list[int], b_shape: list[int]
            ) -> tuple[list[int], list[int]] | None:
    """The intersection of two boxes as (offsets, shape), or None when they do not meet."""
    lo = [max(x, y) for x, y in zip(a_off, b_off, strict=True)]
    hi = [min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, [h - low for low, h in zip(lo, hi, strict=True)]


def listed_boxes(states: dict[str, Any]) -> tuple[str, int] | None:
    """The box table a split body's index names (digest, bytes); None where it names none (a
    single-rank body, or one written before the table)."""
    dist = states.get("dist")
    if not isinstance(dist, dict) or "boxes" not in dist:
        return None
    named = dist["boxes"]
    if not (isinstance(named, list) and len(named) == 2 and isinstance(named[0], str)
            and isinstance(named[1], int) and not isinstance(named[1], bool)):
        raise CorruptObject("body", "'dist.boxes' is not [digest, bytes]")
    return str(named[0]), int(named[1])


def _list(value: Any, kind: type) -> list[Any]:
    if not isinstance(value, list) or not all(isinstance(x, kind) for x in value):
        raise ValueError(f"expected a list of {kind.__name__}")
    return value


def _ints(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise ValueError("expected a list of integers")
    return tuple(value)
