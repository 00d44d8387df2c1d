"""Garbage collection of unreferenced chunks and bodies, safe against concurrent saves.

Protocol (docs/format.md, "Garbage collection"):

* a save first creates ``inflight/<token>.json``, then checks for ``locks/gc.json``; if the lock
  exists it deletes its marker, waits for the lock to go, and starts again;
* ``gc`` creates ``locks/gc.json`` (create-if-absent), then waits until no live in-flight marker
  remains, bumps ``locks/gc-epoch.json``, computes what every manifest and body still references,
  deletes the rest, and removes its lock.

Either the save's marker exists before the lock (gc waits for the save), or the save sees the
lock (and waits for gc): a save never references a chunk that gc is deleting. A writer that
caches "chunks the store has" drops its cache when the epoch changes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from ciuic import knobs
from ciuic.chain.references import Damage, References, explain, quarantine, referenced
from ciuic.chain.repo import Repository
from ciuic.chain.runs import IDENTITY, pid_alive
from ciuic.errors import (
    CiuicError,
    CorruptObject,
    DiskFull,
    ObjectNotFound,
    StoreError,
)
from ciuic.format import canonical, layout
from ciuic.format.layout import digest_of_key
from ciuic.store import LocalStore, Store
from ciuic.store.http import HttpStore
from ciuic.words import counted

log = logging.getLogger("ciuic")
T = TypeVar("T")


def _marker() -> bytes:
    return json.dumps({**IDENTITY, "pid": os.getpid(), "time": time.time()}).encode()


def _is_live(store: Store, key: str, stale_s: float) -> bool:
    """Whether a marker or lock still belongs to a running process.

    On the same machine (same host, boot and PID namespace) the pid decides; elsewhere the
    marker's age does (its owner refreshes it while it works).
    """
    try:
        info = canonical.parse(store.get(key), key, "gc marker", floats=True)
    except (ObjectNotFound, CorruptObject):
        return False
    pid, at = (info.get("pid", -1), info.get("time", 0)) if isinstance(info, dict) else (-1, 0)
    if not (isinstance(pid, int) and isinstance(at, (int, float))):
        return False  # not a marker ciuic wrote: damaged
    same_machine = all(info.get(k) == v for k, v in IDENTITY.items()) and IDENTITY["pidns"]
    if same_machine and not pid_alive(pid):
        return False
    return bool(time.time() - float(at) < stale_s)


def read_epoch(store: Store) -> int:
    try:
        return int(canonical.parse(store.get(layout.GC_EPOCH), layout.GC_EPOCH, "gc epoch",
                                   floats=True)["epoch"])
    except ObjectNotFound:
        return 0
    except (CorruptObject, ValueError, KeyError, TypeError):
        return -1


class InflightSave:
    """Marks a save in progress so that ``gc`` never deletes what it may reference."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.key = layout.inflight_key(f"{secrets.token_hex(12)}.json")
        self.epoch = 0

    def __enter__(self) -> InflightSave:
        deadline = time.monotonic() + knobs.get().gc_wait_s
        local = _local(self.store)
        if local is not None:
            local.keep_reserve()  # for a gc on a full disk
        while True:
            # marker first, then look for the lock (see the module docstring for why)
            self.store.put(self.key, _marker())
            if not self.store.has(layout.GC_LOCK) or not _is_live(
                self.store, layout.GC_LOCK, knobs.get().gc_lock_stale_s
            ):
                self.epoch = read_epoch(self.store)
                return self
            self.store.delete(self.key)
            if time.monotonic() > deadline:
                raise StoreError(
                    "a `ciuic gc` has held the store's lock for too long; the snapshot was "
                    f"skipped. If no gc is running, delete {self.store.location(layout.GC_LOCK)}"
                )
            time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(CiuicError, OSError):
            self.store.delete(self.key)


def _size(store: Store, key: str) -> int:
    """An object's stored size, reading at most its first 16 bytes (0 when it went away)."""
    try:
        return store.get_into(key, [memoryview(bytearray(16))])
    except ObjectNotFound:
        return 0


@dataclass
class GcResult:
    deleted_chunks: int = 0
    deleted_bodies: int = 0
    deleted_bytes: int = 0  # the stored size of the chunks and bodies deleted
    deleted_markers: int = 0
    deleted_temporaries: int = 0
    kept_chunks: int = 0
    #: chunks kept only because a damaged manifest may reference them
    kept_for_damage: int = 0
    skipped: str = ""
    #: the objects gc could not read (references.Damage), and those it moved to quarantine/
    damage: list[Damage] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> GcResult:
        """The result a server's gc route answered (``dataclasses.asdict`` of one)."""
        damage = [Damage(**d) for d in answer.pop("damage", [])]
        return cls(**answer, damage=damage)

    @property
    def damaged(self) -> list[str]:
        return [d.key for d in self.damage]

    def add(self, other: GcResult) -> None:
        """Count ``other``'s (another store's gc) with these; a skip or damage in either is
        said."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, int | list):
                setattr(self, f.name, mine + theirs)
        self.skipped = "; ".join(x for x in (self.skipped, other.skipped) if x)

    def warning(self, command: str = "ciuic gc --quarantine") -> str:
        """What gc did about damaged objects and how to end it (``command``: ``ciuic gc
        --quarantine`` as the person would type it); "" when there were none."""
        return explain(self.damage, self.kept_for_damage, bool(self.quarantined),
                       command) if self.damage else ""


def _served(store: Store) -> HttpStore | None:
    """The server project under ``store``'s wrappers (retries), if it is one."""
    while not isinstance(store, HttpStore):
        inner = getattr(store, "inner", None)
        if not isinstance(inner, Store):
            return None
        store = inner
    return store


class _LockRefresher:
    """Re-writes the gc lock every ``gc_lock_refresh_s`` so that writers see it as live."""

    def __init__(self, store: Store, dry_run: bool) -> None:
        self.store, self.dry_run = store, dry_run
        self.last = time.monotonic()

    def __call__(self) -> None:
        if time.monotonic() - self.last >= knobs.get().gc_lock_refresh_s:
            self.store.put(layout.GC_LOCK, _marker())
            self.last = time.monotonic()


def _local(store: Store) -> LocalStore | None:
    inner = getattr(store, "inner", store)
    return inner if isinstance(inner, LocalStore) else None


def _spare(store: Store, write: Callable[[], T]) -> T:
    """``write()`` (of the gc lock or epoch); on a full disk, again once a local store's reserve
    (store/local.py) is freed for it: gc can then run, and free space, on a full disk."""
    try:
        return write()
    except DiskFull:
        local = _local(store)
        if local is None or not local.release_reserve():
            raise DiskFull(f"gc cannot write its lock in {store.location('locks/')}: the disk is "
                           "full and holds no reserve for gc. Free a few KB outside the store, "
                           "then run `ciuic gc` again") from None
        log.warning("the store's disk is full: gc uses the space held in reserve for it")
        return write()


def collect(repo: Repository, *, dry_run: bool = False, wait_s: float = 0.0,
            progress: Callable[[str], None] | None = None, quarantine_damaged: bool = False,
            only: set[str] | None = None) -> GcResult:
    """Delete chunks and bodies that no manifest references. See the module docstring. A
    project on a ciuic server is collected by the server (clients may not delete chunks).

    ``quarantine_damaged``: first move the damaged manifests and bodies to quarantine/
    (references.py). ``only``: delete only those of these chunk keys that nothing references
    (a failed save's own), and nothing else."""
    store = repo.store
    server = _served(store)
    if server is not None:
        if only is not None:
            return GcResult()  # a failed save's chunks: the server's own gc collects them
        if quarantine_damaged:
            raise CiuicError("a ciuic server's damaged objects are moved aside on its machine: "
                             "run `ciuic --store <the server's storage folder> gc --quarantine` "
                             "there")
        return GcResult.from_answer(server.gc(dry_run, wait_s))
    result = GcResult()
    if not _spare(store, lambda: store.create(layout.GC_LOCK, _marker())):
        if _is_live(store, layout.GC_LOCK, knobs.get().gc_lock_stale_s):
            result.skipped = "another gc is running"
            return result
        # the previous gc died; take its lock over
        _spare(store, lambda: store.put(layout.GC_LOCK, _marker()))
    try:
        deadline = time.monotonic() + wait_s
        while True:
            live = []
            for key in list(store.list(layout.INFLIGHT)):
                if _is_live(store, key, knobs.get().inflight_stale_s):
                    live.append(key)
                elif not dry_run:
                    store.delete(key)
                    result.deleted_markers += 1
            if not live:
                break
            if time.monotonic() >= deadline:
                result.skipped = f"{counted(len(live), 'save')} in progress; run gc again later"
                return result
            time.sleep(0.1)
        if not dry_run:
            epoch = json.dumps({"epoch": read_epoch(store) + 1}).encode()
            _spare(store, lambda: store.put(layout.GC_EPOCH, epoch))
        refs = referenced(repo, progress)
        if quarantine_damaged and refs.damage:
            result.quarantined = ([d.key for d in refs.damage if d.movable] if dry_run
                                  else quarantine(repo, refs.damage))
            if result.quarantined and not dry_run:
                refs = referenced(repo, progress)
        result.damage, result.kept_for_damage = refs.damage, refs.kept_for_damage
        if refs.blocked:  # may reference anything: delete nothing
            result.skipped = ("gc deletes nothing while an object it cannot read may "
                              "reference any chunk")  # warning() says which, and what to do
            return result
        _delete(store, refs, result, dry_run, only)
        return result
    finally:
        store.delete(layout.GC_LOCK)
        local = _local(store)
        if local is not None and not dry_run:
            local.keep_reserve()  # (again, where a full disk took it)


def _delete(store: Store, refs: References, result: GcResult, dry_run: bool,
            only: set[str] | None) -> None:
    """Delete (count, with ``dry_run``) the chunks, packs and bodies ``refs`` does not keep
    (only the chunks and packs of ``only``, where given), then stale temporaries of a local
    store. A pack goes once no snapshot references any piece in it."""
    refresh = _LockRefresher(store, dry_run)
    for key in sorted(only) if only is not None else [
            *store.list(layout.CHUNKS), *store.list(layout.PACKS)]:
        refresh()
        if key in refs.chunks:
            result.kept_chunks += 1
            continue
        if layout.pack_name(key) is None:
            digest_of_key(key)  # only ever delete well-formed chunk and pack keys
        size = _size(store, key)
        if only is not None and not size:
            continue  # never written
        result.deleted_bytes += size
        if not dry_run:
            store.delete(key)
        result.deleted_chunks += 1
    if only is not None:
        return
    for key in list(store.list(layout.JOBS)):
        if layout.parse_body(key) is not None and key not in refs.bodies:
            result.deleted_bytes += _size(store, key)
            if not dry_run:
                store.delete(key)
            result.deleted_bodies += 1
    local = _local(store)
    if local is not None and not dry_run:
        result.deleted_temporaries = local.remove_temporaries(knobs.get().temp_stale_s)
