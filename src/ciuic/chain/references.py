"""What a store's snapshots reference, for gc: every chunk and body a readable manifest's body
names, and what a damaged object may still reference (docs/format.md, "Deletion").

A manifest references chunks only through its body, which lies in its own job's ``bodies/``.
So a manifest that cannot be read (damaged) references, at most, the bodies of its job that
no readable manifest names ("unclaimed") and what those name: gc keeps exactly these, and
collects everything else. A pruned snapshot's body is gone, so its damaged manifest keeps
nothing. Where that bound cannot be read (an unclaimed body that is itself unreadable, a
readable snapshot's body that is damaged, an object in a newer format or sealed with a key
that is not configured, which may be intact and reference anything), gc deletes nothing.

``ciuic gc --quarantine`` moves damaged objects (corrupt, not merely unreadable here) aside to
``quarantine/<their key>``, after which gc frees what only they used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ciuic.chain.read import body_keys, body_states, chunk_refs, object_of
from ciuic.chain.repo import Repository, list_manifests
from ciuic.errors import (
    CiuicError,
    CorruptObject,
    IntegrityError,
    MissingKey,
    ObjectNotFound,
    UnreadableObject,
    UnsupportedFormat,
)
from ciuic.format import canonical, layout
from ciuic.format import manifest as mf
from ciuic.format.descriptor import refs_in
from ciuic.format.digest import is_digest
from ciuic.format.layout import chunk_key
from ciuic.format.parts import BodyPart
from ciuic.words import counted


@dataclass(frozen=True)
class Damage:
    """An object gc cannot read."""

    key: str
    reason: str
    #: the snapshot it is (a manifest) or belongs to (a body); "" for a body no manifest names
    snapshot: str = ""
    #: what it references cannot be bounded: gc deletes nothing while it is there
    blocks: bool = False
    #: damaged (not just unreadable here: a newer format, a key not configured), so that
    #: ``ciuic gc --quarantine`` moves it aside
    movable: bool = True

    @property
    def manifest(self) -> bool:
        return layout.parse_manifest(self.key) is not None


@dataclass
class References:
    #: the keys of the chunk objects and of the packs
    chunks: set[str] = field(default_factory=set)
    bodies: set[str] = field(default_factory=set)
    damage: list[Damage] = field(default_factory=list)
    #: chunks kept only because a damaged manifest may reference them
    kept_for_damage: int = 0

    @property
    def blocked(self) -> list[Damage]:
        return [d for d in self.damage if d.blocks]


def _damage(key: str, e: Exception, snapshot: str, blocks: bool) -> Damage:
    """Damage from the error reading ``key``: one that may be intact blocks gc and stays."""
    reason = e.reason if isinstance(e, UnreadableObject) else str(e)
    intact = isinstance(e, UnsupportedFormat | MissingKey)
    return Damage(key, reason, snapshot, blocks or intact, movable=not intact)


def referenced(repo: Repository, progress: Callable[[str], None] | None = None) -> References:
    """The chunks and bodies every snapshot in the store references, and what gc keeps for
    the damaged objects it found (see the module docstring)."""
    refs = References()
    store = repo.store
    damaged_jobs: set[tuple[str, str]] = set()
    for mk in list_manifests(store):
        if progress:
            progress(mk.key)
        try:
            m = repo.read_manifest(mk.project, mk.job, mk.snapshot_id)
        except ObjectNotFound:
            continue  # gone since it was listed: it references nothing
        except UnreadableObject as e:
            refs.damage.append(_damage(mk.key, e, mk.snapshot_id, blocks=False))
            damaged_jobs.add((mk.project, mk.job))
            continue
        bkey = layout.body_key(mk.project, mk.job, m.body)
        refs.bodies.add(bkey)
        try:
            states = body_states(repo, m)
            refs.bodies.update(body_keys(m, states))  # a split body's parts
        except IntegrityError as e:
            if not store.has(bkey):
                continue  # pruned
            found = _damage(bkey, e, mk.snapshot_id, blocks=True)
            if isinstance(e, UnreadableObject) and e.key != bkey:
                found = Damage(bkey, f"{e.key}: {e.reason}", mk.snapshot_id, True, found.movable)
            refs.damage.append(found)
            continue
        refs.chunks.update(object_of(ref) for ref in chunk_refs(states).values())
    for project, job in sorted(damaged_jobs):
        _keep_unclaimed(repo, project, job, refs)
    return refs


def _keep_unclaimed(repo: Repository, project: str, job: str, refs: References) -> None:
    """Keep the bodies of a job with a damaged manifest that no readable manifest names, and
    every chunk and body they name (a damaged manifest may be theirs)."""
    before = len(refs.chunks)
    for key in [k for k in repo.store.list(layout.bodies_prefix(project, job))
                if layout.parse_body(k) is not None and k not in refs.bodies]:
        refs.bodies.add(key)
        try:
            named, packs = _names(repo, key)
        except ObjectNotFound:
            continue
        except (CiuicError, ValueError) as e:  # its references cannot be known
            refs.damage.append(_damage(key, e, "", blocks=True))
            continue
        refs.chunks.update(chunk_key(d) for d in named)
        refs.chunks.update(layout.pack_key(p) for p in packs)
        refs.bodies.update(layout.body_key(project, job, d) for d in named)  # parts
    refs.kept_for_damage += len(refs.chunks) - before


def _names(repo: Repository, key: str) -> tuple[set[str], set[str]]:
    """Every digest a body or body part names anywhere in it, and the packs its references
    name, once it is checked against its name and parsed as one (so a format this ciuic does
    not know is not guessed at)."""
    body = layout.parse_body(key)
    assert body is not None
    plain, name_key = repo.open_meta(key, repo.store.get(key))
    try:
        mf.decode_body(plain, key, body[2], name_key)
    except UnsupportedFormat:
        raise
    except CorruptObject:
        BodyPart.decode(plain, key, body[2], name_key)  # raises where it is not one either
    tree = canonical.loads(plain)
    return set(_strings(tree)), {r.pack for r in refs_in(tree).values() if r.pack is not None}


def _strings(value: Any) -> Iterator[str]:
    """The digests among the strings of a parsed JSON value."""
    if isinstance(value, str):
        if is_digest(value):
            yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def quarantine(repo: Repository, damage: list[Damage]) -> list[str]:
    """Move each movable damaged object to ``quarantine/<its key>`` (copied there, then
    deleted); a quarantined manifest's snapshot leaves the catalog, a quarantined body's is
    pruned. Returns the keys moved."""
    moved = []
    for d in damage:
        if not d.movable:
            continue
        try:
            data = repo.store.get(d.key)
        except ObjectNotFound:
            continue
        repo.store.put(layout.quarantine_key(d.key), data)
        repo.store.delete(d.key)
        moved.append(d.key)
        if d.snapshot:
            with contextlib.suppress(CiuicError):  # an index: a stale row heals itself
                if d.manifest:
                    repo.catalog.remove_snapshot(d.snapshot)
                else:
                    repo.catalog.set_status(d.snapshot, "pruned")
    return moved


def explain(damage: list[Damage], kept_chunks: int, quarantined: bool = False,
            command: str = "ciuic gc --quarantine") -> str:
    """What gc did about damaged objects, and the command that ends it: said on every gc
    while they are there (the command line's and a training job's)."""
    blocked = [d for d in damage if d.blocks]
    movable = [d for d in damage if d.movable]
    what = counted(len(damage), "damaged or unreadable object")
    if blocked:
        said = (f"{what}, {len(blocked)} of which may reference any chunk (what they "
                "reference cannot be read): gc deletes nothing while they are there")
    elif kept_chunks:
        said = (f"{what}: gc kept the {counted(kept_chunks, 'chunk')} they may reference and "
                "collected the rest")
    else:
        said = (f"{what}: no body they may name is left (their snapshots were pruned), so gc "
                "kept nothing for them and collected the rest")
    todo = []
    if movable and not quarantined:
        todo.append(f"`{command}` moves the damaged ones aside (to quarantine/ in the store; "
                    "their snapshots cannot be restored either way), then collects")
    if any(not d.movable for d in damage):
        todo.append("the others may be intact: upgrade ciuic, or configure the key they are "
                    "sealed with (`ciuic verify` names them)")
    return said + ("; " + "; ".join(todo) if todo else "")
