"""The messages of the two-phase commit (distributed/save.py), as typed records.

They travel as canonical JSON over ciuic's own gloo group (:class:`Collective`); each has one
``to_json`` (the sender's) and one ``from_json`` (the receiver's):

1. :class:`Plan`: every rank to every rank, before writing;
2. :class:`Report`: every rank to the coordinator, after writing (its pieces' descriptors);
3. :class:`Outcome`: the coordinator to every rank, after the commit (or its failure).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ciuic.format.descriptor import TensorDescriptor
from ciuic.format.shards import Meta, Written


@dataclass(frozen=True)
class Plan:
    """A rank's part of the plan: the digest of its global states' structure and of its
    global tensors' metas (``layout``), the digest of every rank's layouts its cached owners
    were planned from (``known``), and its metas only when the plan must be made anew; or the
    error that stopped it before the snapshot."""

    step: int
    seq: int
    error: str | None = None
    metas: list[Meta] = field(default_factory=list)
    skeleton: str = ""
    layout: str = ""
    known: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "seq": self.seq, "error": self.error, "metas": self.metas,
                "skeleton": self.skeleton, "layout": self.layout, "known": self.known}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Plan:
        return cls(step=int(obj["step"]), seq=int(obj["seq"]),
                   error=None if obj["error"] is None else str(obj["error"]),
                   metas=list(obj["metas"]), skeleton=str(obj["skeleton"]),
                   layout=str(obj.get("layout", "")), known=str(obj.get("known", "")))


@dataclass
class Plans:
    """A rank's cache of the last plan: the digest of every rank's layouts it was made from,
    and the owners it gave. While every rank's layout is unchanged, the plan exchange carries
    digests, not metas (each rank would receive every rank's metas: tensors x ranks)."""

    joint: str = ""
    owners: dict[str, int] = field(default_factory=dict)
    made: int = 0  # plans made, for the tests and the benchmark
    exchanged: int = 0  # of them, plans made from every rank's metas (not by rule)
    #: the coordinator's last box table: (the layouts' digest, the store's gc epoch, its
    #: name and bytes or None): the same while neither changes, so it is written once
    table: tuple[str, int, tuple[str, int] | None] | None = None
    #: the owner of a piece ``owners`` does not list (a plan adopted from a restored
    #: snapshot lists only the pieces of this rank's that other ranks wrote); None: all listed
    default: int | None = None

    def owner(self, key: str) -> int:
        """The rank that writes piece ``key``."""
        found = self.owners.get(key, self.default)
        if found is None:  # a programming error: the plan covers every piece
            raise KeyError(f"the plan has no owner for {key}")
        return found


@dataclass(frozen=True)
class Report:
    """What a rank wrote: the bytes of its new chunks, its part of the body (digest and bytes:
    the descriptors of its shards and its per-rank states), the statistics of its per-rank
    float tensors (for the health verdict, by path under ``ranks/<rank>/``) and the descriptor
    of each replicated global tensor it owns; or its error."""

    error: str | None = None
    new: int = 0
    #: the number of this rank's per-rank tensors, and their bytes
    tensors: int = 0
    own_bytes: int = 0
    written: list[Written] = field(default_factory=list)
    part: tuple[str, int] = ("", 0)
    #: [path, elements, stats JSON] of each per-rank float tensor
    stats: list[list[Any]] = field(default_factory=list)
    #: [layout class, offsets, shape] of each box this rank holds, once per class (the box
    #: table: format/boxes.py)
    held: list[list[Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error, "new": self.new, "tensors": self.tensors,
                "own_bytes": self.own_bytes, "part": list(self.part), "stats": self.stats,
                "held": self.held,
                "written": [{"path": w.path, "offsets": w.offsets, "desc": w.desc.to_json()}
                            for w in self.written]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Report:
        if obj["error"] is not None:
            return cls(error=str(obj["error"]))
        d, n = obj["part"]
        return cls(new=int(obj["new"]), tensors=int(obj["tensors"]),
                   own_bytes=int(obj["own_bytes"]), part=(str(d), int(n)),
                   stats=[list(x) for x in obj["stats"]],
                   held=[list(x) for x in obj.get("held", [])],
                   written=[Written(str(w["path"]),
                                    None if w["offsets"] is None else list(w["offsets"]),
                                    TensorDescriptor.from_json(w["desc"], str(w["path"])))
                            for w in obj["written"]])


@dataclass(frozen=True)
class Outcome:
    """The commit's outcome: the snapshot's ID and manifest bytes, or each failed rank's
    error (by rank)."""

    failures: dict[int, str] = field(default_factory=dict)
    sid: str = ""
    manifest: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"failures": {str(r): e for r, e in self.failures.items()}, "sid": self.sid,
                "manifest": self.manifest}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Outcome:
        return cls(failures={int(r): str(e) for r, e in obj["failures"].items()},
                   sid=str(obj["sid"]), manifest=str(obj["manifest"]))
